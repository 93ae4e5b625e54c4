"""DDP on 2 gloo processes: one-file save/load, collectives, distributed data loading, rank_zero_first."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from minifabric import Accelerator, CheckpointError
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _setup(acc: Accelerator, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))


def _checkpoint(acc: Accelerator, tmp: Path) -> dict:
    model, optimizer = _setup(acc, seed=0)
    torch.manual_seed(acc.global_rank)
    acc.backward(model(torch.randn(4, 4)).sum())
    optimizer.step()
    acc.save(tmp / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 3, "note": "extra"})

    fresh_model, fresh_optimizer = _setup(acc, seed=1)
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    leftovers = acc.load(tmp / "ckpt.pt", state)
    try:
        acc.load(tmp / "ckpt.pt", {"model": nn.Linear(4, 3)})
        strict_error = ""
    except CheckpointError as err:
        strict_error = str(err)
    return {
        "leftovers": leftovers,
        "step": state["step"],
        "equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True)
        ),
        "optimizer_equal": torch.equal(
            optimizer.state[model.weight]["exp_avg"], fresh_optimizer.state[fresh_model.weight]["exp_avg"]
        ),
        "strict_error": strict_error,
    }


def _collectives(acc: Accelerator) -> dict:
    rank = acc.global_rank
    return {
        "gathered": acc.all_gather(torch.tensor([rank, 10 + rank])),
        "sum": acc.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum"),
        "mean": acc.all_reduce(rank + 1, reduce_op="mean"),
        "max": acc.all_reduce(torch.tensor(rank), reduce_op="max"),
        "broadcast": acc.broadcast({"from": rank}, src=1),
    }


def _data(acc: Accelerator) -> dict:
    acc.seed_everything(0)
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True))
    epochs = [torch.cat([batch[0] for batch in loader]).tolist() for _ in range(2)]
    return {"epochs": epochs, "epoch_set": loader.sampler.epoch}


def _rank_zero_first(acc: Accelerator, tmp: Path) -> bool:
    marker = tmp / "prepared"
    with acc.rank_zero_first():
        if acc.global_rank == 0:
            marker.write_text("done")
        seen = marker.exists()
    return seen


def _rank(rank: int, tmp: str) -> dict:
    acc = Accelerator(accelerator="cpu", devices=2)
    acc.launch()
    return {
        "checkpoint": _checkpoint(acc, Path(tmp)),
        "collectives": _collectives(acc),
        "data": _data(acc),
        "rank_zero_first": _rank_zero_first(acc, Path(tmp)),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_rank, 2, str(tmp_path_factory.mktemp("ddp_state")), timeout=170)


def test_save_load_round_trip_on_every_rank(results):
    for rank, result in enumerate(results):
        checkpoint = result["checkpoint"]
        assert checkpoint["equal"] and checkpoint["optimizer_equal"], f"rank {rank}"
        assert checkpoint["step"] == 3
        assert checkpoint["leftovers"] == {"note": "extra"}
        assert "model.weight: checkpoint (2, 4), model (3, 4)" in checkpoint["strict_error"]


def test_collectives_on_two_processes(results):
    for result in results:
        collectives = result["collectives"]
        assert collectives["gathered"].tolist() == [[0, 10], [1, 11]]
        assert collectives["sum"].item() == 3.0
        assert collectives["mean"].item() == 1.5
        assert collectives["max"].item() == 1
        assert collectives["broadcast"] == {"from": 1}


def test_each_rank_gets_its_half_of_every_epoch(results):
    for epoch in range(2):
        halves = [r["data"]["epochs"][epoch] for r in results]
        assert len(halves[0]) == len(halves[1]) == 8
        assert sorted(halves[0] + halves[1]) == list(range(16))
    for result in results:
        assert result["data"]["epoch_set"] == 1
        assert result["data"]["epochs"][0] != result["data"]["epochs"][1]  # reshuffled per epoch


def test_rank_zero_runs_first(results):
    assert all(r["rank_zero_first"] for r in results)
