"""Lightning Fabric checkpoints (a sharded folder with ``meta.pt``) resume with ``acc.load``; a saved
model state dict of DTensors is saved whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.checkpoint_common import (
    Net,
    accelerator,
    assert_same,
    run_ranks,
    setup,
    snapshot,
    train,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _fabric_folder(rank: int, root: str) -> dict:
    from lightning_fabric.strategies.model_parallel import _save_checkpoint

    acc = accelerator(2)
    model, optimizer, scheduler = setup(acc)
    train(acc, model, optimizer, scheduler, 2)
    # what Fabric's ModelParallelStrategy (FSDP2) writes (given the unwrapped objects, as Fabric
    # passes them): DCP files and meta.pt, no commit record
    state = {"model": model.module, "optimizer": optimizer.optimizer, "scheduler": scheduler, "step": 2}
    _save_checkpoint(Path(root) / "fabric", state, full_state_dict=False, rank=rank)
    acc.barrier()
    expected = snapshot(model, optimizer)

    torch.manual_seed(9)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh, fresh_opt, fresh_sched = acc.setup(fresh, fresh_opt, scheduler=fresh_sched)
    loaded = {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "step": 0}
    acc.load(Path(root) / "fabric", loaded)
    return {
        "expected": expected,
        "loaded": snapshot(fresh, fresh_opt),
        "step": loaded["step"],
        "epoch": fresh_sched.last_epoch,
    }


def test_a_sharded_lightning_fabric_folder_resumes_with_load(tmp_path: Path) -> None:
    for result in run_ranks(_fabric_folder, 2, str(tmp_path)):
        assert_same(result["loaded"]["model"], result["expected"]["model"])
        assert_same(result["loaded"]["optimizer"]["state"], result["expected"]["optimizer"]["state"])
        assert result["loaded"]["optimizer"]["param_groups"][0]["lr"] == 0.025
        assert result["step"] == 2 and result["epoch"] == 2


def _save_state_dict(rank: int, root: str) -> dict:
    acc = accelerator(2)
    model, optimizer, scheduler = setup(acc)
    train(acc, model, optimizer, scheduler, 1)
    acc.save(Path(root) / "sharded", model.state_dict())  # a dict of DTensors, as Fabric scripts do
    acc.strategy.state_dict_type = "full"
    acc.save(Path(root) / "full.pt", model.state_dict())
    return snapshot(model, optimizer)["model"]


def test_saving_model_state_dict_under_fsdp_saves_every_shard(tmp_path: Path) -> None:
    from minifabric import Accelerator

    expected = run_ranks(_save_state_dict, 2, str(tmp_path))[0]
    acc = Accelerator(accelerator="cpu", devices=1)
    for name in ("sharded", "full.pt"):
        loaded = acc.load(tmp_path / name)
        assert_same(loaded, expected, name)  # every row, not rank 0's half
        plain = Net()
        plain.load_state_dict(loaded)


def test_consolidating_a_saved_state_dict_writes_every_tensor(tmp_path: Path) -> None:
    """``acc.save(path, model.state_dict())`` under FSDP (Fabric's idiom) consolidates into real tensors."""
    from minifabric import Accelerator
    from minifabric.checkpoint.consolidate import consolidate

    expected = run_ranks(_save_state_dict, 2, str(tmp_path))[0]
    consolidate(tmp_path / "sharded", tmp_path / "consolidated.pt")
    data = torch.load(tmp_path / "consolidated.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in data["state"].values()), data["state"]
    assert_same(data["state"], expected, "consolidated file")
    loaded = Accelerator(accelerator="cpu", devices=1).load(tmp_path / "consolidated.pt")
    assert_same(loaded, expected, "consolidated, loaded")
