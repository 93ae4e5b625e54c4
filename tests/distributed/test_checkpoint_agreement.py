"""A failure on one rank is agreed by all (save and load), values `load` could not read are refused at
`save`, optimizer state follows parameter names, and an asynchronous save is a snapshot."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from minifabric.checkpoint import CheckpointError
from minifabric.checkpoint.errors import UnsaveableValueError
from tests.distributed.checkpoint_common import (
    accelerator,
    assert_same,
    committed_digest,
    full,
    run_ranks,
    setup,
    snapshot,
    train,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


class _Flaky:
    """A stateful object whose ``state_dict`` fails on one rank."""

    def __init__(self, rank: int, bad_rank: int) -> None:
        self.fail = rank == bad_rank

    def state_dict(self) -> dict:
        if self.fail:
            raise ValueError("state of the sampler is unavailable")
        return {"position": 3}

    def load_state_dict(self, state: dict) -> None:
        pass


def _failures(rank: int, root_name: str) -> dict:
    root = Path(root_name)
    acc = accelerator(2)
    model, optimizer, scheduler = setup(acc)
    train(acc, model, optimizer, scheduler, 1)
    state = {"model": model, "optimizer": optimizer, "step": 1}
    acc.save(root / "ckpt", state)
    digest = committed_digest(root / "ckpt")
    out: dict = {}

    def attempt(name: str, call) -> None:
        start = time.monotonic()
        with pytest.raises(CheckpointError) as caught:
            call()
        out[name] = (type(caught.value).__name__, str(caught.value), time.monotonic() - start)
        assert committed_digest(root / "ckpt") == digest, name
        assert not list((root / "ckpt").glob(".partial-*")), name  # removed before any rank raised
        acc.barrier()  # no rank starts the next save (a new staging folder) while another still checks

    attempt("stateful", lambda: acc.save(root / "ckpt", {**state, "sampler": _Flaky(rank, 1)}))
    lam = (lambda x: x) if rank == 1 else 1
    attempt("lambda", lambda: acc.save(root / "ckpt", {**state, "fn": lam}))
    attempt("namespace", lambda: acc.save(root / "ckpt", {**state, "args": argparse.Namespace(lr=0.1)}))
    # load: a mismatch on one rank only, then a damaged shard: every rank fails, nothing changes
    before = snapshot(model, optimizer)
    extra = {"other": 1} if rank == 1 else {}
    attempt("load_one_rank", lambda: acc.load(root / "ckpt", {**state, **extra}))
    acc.barrier()
    if rank == 0:
        version = root / "ckpt" / (root / "ckpt" / "LATEST").read_text()
        shard = version / "__1_0.distcp"
        shard.write_bytes(b"\0" * shard.stat().st_size)
    acc.barrier()
    start = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        acc.load(root / "ckpt", {"model": model, "optimizer": optimizer})
    out["damaged"] = (type(caught.value).__name__, str(caught.value), time.monotonic() - start)
    assert_same(before, snapshot(model, optimizer))
    return out


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank_and_changes_nothing(
    tmp_path: Path,
) -> None:
    results = run_ranks(_failures, 2, str(tmp_path))
    for name in results[0]:
        kinds = {r[name][0] for r in results}
        messages = {r[name][1] for r in results}
        assert len(messages) == 1 and len(kinds) == 1, (name, messages)
        assert all(r[name][2] < 10 for r in results), name  # seconds, not a collective timeout
    assert "rank 1: ValueError: state of the sampler is unavailable" in results[0]["stateful"][1]
    assert results[0]["lambda"][0] == "UnsaveableValueError" and "state['fn']" in results[0]["lambda"][1]
    kind, message, _ = results[0]["namespace"]
    assert kind == "UnsaveableValueError" and "state['args']" in message and "vars(args)" in message
    assert "other" in results[0]["load_one_rank"][1]
    assert "__1_0.distcp" in results[0]["damaged"][1] or "rank" in results[0]["damaged"][1]
    assert issubclass(UnsaveableValueError, TypeError)


class _Forward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class _Reversed(_Forward):
    """The same names and shapes, registered in the other order (so ``parameters()`` is reversed)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.second = nn.Linear(6, 6)
        self.first = nn.Linear(6, 6)


def _by_name(rank: int, root: str) -> dict:
    acc = accelerator(2)
    torch.manual_seed(0)
    model = _Forward()
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    train_x = torch.randn(4, 6)
    for _ in range(2):
        acc.backward(model(train_x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    acc.save(f"{root}/ckpt", {"model": model, "optimizer": optimizer})
    saved = {name: full(optimizer.state[p]) for name, p in model.named_parameters()}
    other = _Reversed()
    other, other_opt = acc.setup(other, torch.optim.AdamW(other.parameters(), lr=0.5))
    acc.load(f"{root}/ckpt", {"model": other, "optimizer": other_opt})
    loaded = {name: full(other_opt.state[p]) for name, p in other.named_parameters()}
    # a model with a layer more: the model's missing key is named before the optimizer's groups
    wider = nn.Sequential()
    wider.first, wider.second, wider.third = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
    wider, wider_opt = acc.setup(wider, torch.optim.AdamW(wider.parameters()))
    with pytest.raises(CheckpointError) as caught:
        acc.load(f"{root}/ckpt", {"model": wider, "optimizer": wider_opt})
    return {
        "saved": saved,
        "loaded": loaded,
        "lr": other_opt.param_groups[0]["lr"],
        "error": str(caught.value),
    }


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path: Path) -> None:
    for result in run_ranks(_by_name, 2, str(tmp_path)):
        for name, values in result["saved"].items():
            for key, value in values.items():
                assert torch.equal(result["loaded"][name][key], value), (name, key)
        assert result["lr"] == 0.1
        message = result["error"]
        assert message.index("model.third.weight") < message.index("parameter group")


def _snapshot_run(rank: int, root: str) -> dict:
    acc = accelerator(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(8, 6)).square().mean())
    optimizer.step()
    expected = full(model.state_dict())
    handle = acc.save(f"{root}/ckpt", {"model": model}, asynchronous=True)  # the optimizer is not in state
    acc.backward(model(torch.randn(8, 6) * 3).square().mean())  # BatchNorm updates its statistics
    optimizer.step()
    handle.wait()
    changed = full(model.state_dict())
    fresh = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    fresh = acc.setup(fresh)
    acc.load(f"{root}/ckpt", {"model": fresh})
    return {"expected": expected, "changed": changed, "loaded": full(fresh.state_dict())}


def test_asynchronous_save_is_the_state_at_the_call(tmp_path: Path) -> None:
    for result in run_ranks(_snapshot_run, 2, str(tmp_path)):
        for key, value in result["expected"].items():
            assert torch.equal(result["loaded"][key], value), key
        assert not torch.equal(result["changed"]["1.running_mean"], result["expected"]["1.running_mean"])
        assert not torch.equal(result["changed"]["0.weight"], result["expected"]["0.weight"])


def _subset(rank: int, root: str) -> dict:
    acc = accelerator(2)
    model, _, _ = setup(acc)
    big = acc.setup(nn.Linear(256, 256))
    big_opt = acc.setup_optimizers(torch.optim.AdamW(big.parameters()))
    acc.backward(big(torch.randn(2, 256)).sum())
    big_opt.step()
    acc.save(f"{root}/ckpt", {"model": model, "big": big, "big_opt": big_opt})
    rest = acc.load(f"{root}/ckpt", {"model": model})
    tensors = [t for entry in rest.values() for t in _leaves(entry) if isinstance(t, torch.Tensor)]
    local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)
    whole = sum(t.numel() * t.element_size() for t in tensors)
    exp_avg = rest["big_opt"]["state"]["weight"]["exp_avg"]
    live = full(big_opt.state[big.weight]["exp_avg"])
    return {"local": local, "whole": whole, "exp_avg": exp_avg.full_tensor(), "live": live}


def _leaves(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def test_entries_not_asked_for_are_read_sharded_not_whole_on_every_rank(tmp_path: Path) -> None:
    for result in run_ranks(_subset, 2, str(tmp_path)):
        assert result["local"] < 0.55 * result["whole"], result  # about half per rank, not all of it
        assert torch.equal(result["exp_avg"], result["live"])
