"""Exact resume: stopped mid-epoch, saved, resumed in a new process, a run is bit-identical to the
uninterrupted one, with a loop that saves only model, optimizer, scheduler, dataloader and step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from minifabric import Accelerator
from tests.distributed.checkpoint_common import Net, assert_same, full, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

TOTAL, STOP = 12, 7  # 40 samples, batch 4: 10 batches per epoch on 1 rank, 5 on 2; STOP is mid-epoch


def _train(rank: int, mode: str, path: str, restore_scheduler: bool = True) -> dict:
    world_size = int(os.environ["WORLD_SIZE"])
    acc = Accelerator(accelerator="cpu", strategy="fsdp" if world_size > 1 else "single", devices=world_size)
    acc.launch()
    acc.seed_everything(42)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = acc.setup(model, optimizer, scheduler=scheduler)
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(40, 8, generator=data), torch.randn(40, 2, generator=data))
    loader = acc.setup_dataloaders(DataLoader(dataset, batch_size=4, shuffle=True))

    step, losses = 0, []
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "dataloader": loader,
        "step": step,
    }
    if mode == "resume":
        if not restore_scheduler:
            del state["scheduler"]
        acc.load(path, state)
        step = state["step"]
    while step < TOTAL:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)  # the model has dropout: per-rank RNG matters
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            if mode == "first" and step == STOP:
                state["step"] = step
                acc.save(path, state)
                return {"losses": losses}
            if step == TOTAL:
                break
    return {"losses": losses, "weights": full(model.state_dict())}


def _interrupted(
    tmp_path: Path, world_size: int, restore_scheduler: bool = True
) -> tuple[list[dict], list[dict]]:
    path = str(tmp_path / "ckpt")
    first = run_ranks(_train, world_size, "first", path)
    resumed = run_ranks(_train, world_size, "resume", path, restore_scheduler)
    return first, resumed


@pytest.mark.parametrize("world_size", [1, 2])
def test_resumed_run_is_bit_identical_to_uninterrupted(tmp_path: Path, world_size: int) -> None:
    reference = run_ranks(_train, world_size, "full", "")
    first, resumed = _interrupted(tmp_path, world_size)
    for rank in range(world_size):
        assert len(first[rank]["losses"]) == STOP
        assert first[rank]["losses"] + resumed[rank]["losses"] == reference[rank]["losses"]
        assert_same(resumed[rank]["weights"], reference[rank]["weights"])


def test_resume_that_skips_the_scheduler_is_caught(tmp_path: Path) -> None:
    reference = run_ranks(_train, 1, "full", "")
    first, resumed = _interrupted(tmp_path, 1, restore_scheduler=False)
    assert first[0]["losses"] + resumed[0]["losses"] != reference[0]["losses"]
    assert not torch.equal(resumed[0]["weights"]["head.weight"], reference[0]["weights"]["head.weight"])
