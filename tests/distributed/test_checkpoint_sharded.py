"""Sharded checkpoints on real ranks: resharding N -> M, full <-> sharded, async save, consolidation."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from minifabric import Accelerator
from minifabric.checkpoint.consolidate import consolidate
from tests.distributed.checkpoint_common import (
    Net,
    accelerator,
    assert_same,
    run_ranks,
    setup,
    snapshot,
    train,
)
from tests.helpers import run_command

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _state(acc: Accelerator, seed: int) -> dict:
    """Two models with their optimizers (AdamW + scheduler, SGD with momentum), and plain values."""
    model, optimizer, scheduler = setup(acc, seed)
    torch.manual_seed(seed + 100)
    teacher = Net()
    teacher_opt = torch.optim.SGD(teacher.parameters(), lr=0.1, momentum=0.9)
    teacher, teacher_opt = acc.setup(teacher, teacher_opt)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "teacher": teacher,
            "teacher_opt": teacher_opt, "step": 0, "note": "n/a"}  # fmt: skip


def _snapshot(state: dict) -> dict:
    return {
        "student": snapshot(state["model"], state["optimizer"]),
        "teacher": snapshot(state["teacher"], state["teacher_opt"]),
        "scheduler": state["scheduler"].state_dict(),
        "step": state["step"],
        "note": state["note"],
    }


def _train_all(acc: Accelerator, state: dict, steps: int) -> None:
    train(acc, state["model"], state["optimizer"], state["scheduler"], steps)
    train(acc, state["teacher"], state["teacher_opt"], None, steps, seed=2)


def _save_run(rank: int, root: str) -> dict:
    acc = accelerator(2)
    state = _state(acc, seed=0)
    _train_all(acc, state, 3)
    state.update(step=3, note="three steps")
    acc.save(f"{root}/s2", state)
    acc.strategy.state_dict_type = "full"
    acc.save(f"{root}/f2.pt", state)
    acc.strategy.state_dict_type = "sharded"
    saved = _snapshot(state)
    # The same step once synchronously and once in the background while training goes on.
    acc.save(f"{root}/sync", state)
    handle = acc.save(f"{root}/async", state, asynchronous=True)
    _train_all(acc, state, 2)
    acc.save(f"{root}/later", {"model": state["model"]})  # waits for the asynchronous save first
    assert handle.done()
    handle.wait()
    return {"saved": saved, "trained_on": _snapshot(state)}


def _load_run(rank: int, root: str, src: str, dst: str | None) -> dict:
    acc = accelerator(_world())
    state = _state(acc, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load(f"{root}/{src}", state)
    loaded = _snapshot(state)
    _train_all(acc, state, 1)
    if dst:
        acc.save(f"{root}/{dst}", state)
    return {"loaded": loaded, "after": _snapshot(state), "warnings": [str(w.message) for w in caught]}


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("sharded")
    results = run_ranks(_save_run, 2, str(root))
    assert_same(results[0]["saved"], results[1]["saved"])
    return root, results


def test_two_ranks_reshard_to_four_then_two_and_three(saved: tuple[Path, list[dict]]) -> None:
    root, results = saved
    expected = results[0]["saved"]
    four = run_ranks(_load_run, 4, str(root), "s2", "s4")
    for result in four:
        assert_same(result["loaded"], expected)
        assert any("NOT restored" in w and "RNG" in w for w in result["warnings"])
    assert_same(four[0]["after"], four[3]["after"])
    two = run_ranks(_load_run, 2, str(root), "s4", None)
    for result in two:
        assert_same(result["loaded"], four[0]["after"])
    three = run_ranks(_load_run, 3, str(root), "f2.pt", None)  # full -> sharded on 3 ranks
    for result in three:
        assert_same(result["loaded"], expected)
        after, before = result["after"]["student"]["model"], expected["student"]["model"]
        assert not torch.equal(after["head.weight"], before["head.weight"])  # training continues


def _plain_state() -> tuple[Accelerator, dict]:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    return acc, _state(acc, seed=9)


def test_sharded_and_full_load_into_a_plain_module_without_process_group(
    saved: tuple[Path, list[dict]],
) -> None:
    root, results = saved
    acc, state = _plain_state()
    assert not torch.distributed.is_initialized()
    for name in ("s2", "f2.pt"):
        with pytest.warns(UserWarning, match="saved by 2 process"):
            acc.load(root / name, state)
        assert_same(_snapshot(state), results[0]["saved"])
    _train_all(acc, state, 1)  # training continues from the loaded state


def test_async_save_equals_sync_save_of_the_same_step(saved: tuple[Path, list[dict]]) -> None:
    root, results = saved
    acc, first = _plain_state()
    _, second = _plain_state()
    with pytest.warns(UserWarning):
        acc.load(root / "sync", first)
        acc.load(root / "async", second)
    assert_same(_snapshot(first), _snapshot(second))
    assert_same(_snapshot(first), results[0]["saved"])
    trained = results[0]["trained_on"]["student"]["model"]
    assert not torch.equal(trained["head.weight"], first["model"].state_dict()["head.weight"])


def test_consolidated_file_loads_weights_only_and_equals_the_shards(
    saved: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    root, results = saved
    out = consolidate(root / "s2", tmp_path / "merged.pt")
    data = torch.load(out, weights_only=True)
    assert_same(data["state"]["model"], results[0]["saved"]["student"]["model"])
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    plain = Net()
    acc.load_raw(out, plain)  # two module entries: load_raw takes the one named "model"
    assert_same(dict(plain.state_dict()), results[0]["saved"]["student"]["model"])
    cli = run_command(
        [sys.executable, "-m", "minifabric", "consolidate", str(root / "s2"), str(tmp_path / "cli.pt")]
    )
    assert cli.returncode == 0, cli.stderr
    assert_same(torch.load(tmp_path / "cli.pt", weights_only=True)["state"], data["state"])
