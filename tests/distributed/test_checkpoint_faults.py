"""Crash safety: a rank killed (SIGKILL) at every step of a save, or out of disk space, never costs the
previous checkpoint, and the interrupted save is refused. A failure on one rank is agreed by all."""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from minifabric import Accelerator
from minifabric.checkpoint import CheckpointError
from minifabric.checkpoint.commit import FAULT_ENV, wait_for_cleanup
from tests.distributed.checkpoint_common import (
    Net,
    accelerator,
    committed_digest,
    run_ranks,
    setup,
    snapshot,
    train,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _kill_when_shard_appears(root: Path, rank: int) -> None:
    """SIGKILL this process as soon as its shard file exists in a staging folder (mid-write)."""

    def watch() -> None:
        while True:
            if any(root.glob(f"ckpt/.partial-*/__{rank}_*.distcp")):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)

    threading.Thread(target=watch, daemon=True).start()


def _save_twice(rank: int, root_name: str, fault: str) -> str | None:
    root = Path(root_name)
    acc = accelerator(2)
    model, optimizer, scheduler = setup(acc)
    big = acc.setup(torch.nn.Linear(1024, 1024))  # a few MB per shard, so a kill can land mid-write
    train(acc, model, optimizer, scheduler, 1)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "big": big, "step": 1}
    acc.save(root / "ckpt", state)
    expected = snapshot(model, optimizer)
    if rank == 0:
        torch.save(expected, root / "expected.pt")
        (root / "digest.json").write_text(json.dumps(committed_digest(root / "ckpt")))
    acc.barrier()
    train(acc, model, optimizer, scheduler, 1)
    state["step"] = 2
    if fault == "disk_full":
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        with pytest.raises(CheckpointError) as caught:
            acc.save(root / "ckpt", state)
        return str(caught.value)
    if fault == "during":
        if rank == 1:
            _kill_when_shard_appears(root, rank)
    else:
        os.environ[FAULT_ENV] = fault
    acc.save(root / "ckpt", state)
    return None


def _plain() -> tuple[Accelerator, dict]:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    torch.manual_seed(5)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters())
    return acc, {"model": model, "optimizer": optimizer, "big": torch.nn.Linear(1024, 1024), "step": 0}


# Every point of an overwriting save where a kill leaves the previous checkpoint, in order; then
# the points after the pointer was replaced, which leave the new one.
KILLS = [
    "before_shard:1",
    "during",
    "after_shard:1",
    "after_shard:0",
    "before_commit:0",
    "after_commit_record:0",
    "after_rename:0",
    "after_pointer_tmp:0",
]
KILLS_AFTER_COMMIT = ["after_pointer:0", "after_cleanup:0"]


@pytest.mark.parametrize("fault", KILLS)
def test_killed_rank_leaves_previous_checkpoint_intact(tmp_path: Path, fault: str) -> None:
    with pytest.raises((RuntimeError, AssertionError)):
        run_ranks(_save_twice, 2, str(tmp_path), fault)
    assert committed_digest(tmp_path / "ckpt") == json.loads((tmp_path / "digest.json").read_text())
    acc, state = _plain()
    with pytest.warns(UserWarning, match="saved by 2"):
        acc.load(tmp_path / "ckpt", state, strict=False)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for key, value in expected["model"].items():
        assert torch.equal(state["model"].state_dict()[key], value), key
    assert state["step"] == 1
    for partial in (tmp_path / "ckpt").glob(".partial-*"):
        if not (partial / "COMMIT.json").exists():
            with pytest.raises(CheckpointError, match="interrupted save"):
                acc.load(partial, state)
    acc.strategy.state_dict_type = "sharded"
    acc.save(tmp_path / "ckpt", {"model": state["model"]})  # the next save clears the leftovers ...
    wait_for_cleanup()  # ... on a background thread
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "LATEST",
        committed_digest(tmp_path / "ckpt")["pointer"],
    ]


@pytest.mark.parametrize("fault", KILLS_AFTER_COMMIT)
def test_killed_after_the_pointer_leaves_the_new_checkpoint(tmp_path: Path, fault: str) -> None:
    with pytest.raises((RuntimeError, AssertionError)):
        run_ranks(_save_twice, 2, str(tmp_path), fault)
    acc, state = _plain()
    with pytest.warns(UserWarning, match="saved by 2"):
        acc.load(tmp_path / "ckpt", state)
    assert state["step"] == 2
    acc.strategy.state_dict_type = "sharded"
    acc.save(tmp_path / "ckpt", {"model": state["model"]})
    wait_for_cleanup()
    assert len(list((tmp_path / "ckpt").iterdir())) == 2


def test_disk_full_on_one_rank_fails_on_every_rank_and_keeps_previous(tmp_path: Path) -> None:
    messages = run_ranks(_save_twice, 2, str(tmp_path), "disk_full")
    for message in messages:
        assert "rank 1" in message and "File too large" in message and "previous checkpoint" in message
    assert committed_digest(tmp_path / "ckpt") == json.loads((tmp_path / "digest.json").read_text())
    assert not list((tmp_path / "ckpt").glob(".partial-*"))
    acc, state = _plain()
    with pytest.warns(UserWarning):
        acc.load(tmp_path / "ckpt", state)
    assert state["step"] == 1
