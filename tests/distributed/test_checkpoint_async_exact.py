"""``save(..., asynchronous=True)`` writes the state at the call on every rank (FSDP, 2 ranks).

After the call returns, each rank changes its parameters outside ``optimizer.step()`` (SAM's first
step, a clamp), a tensor among ``state``'s values in place, and steps; the copy is slowed down, so a
copy taken after the call would see those changes. Loaded back, every rank holds the state at the call.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.distributed.checkpoint_common import accelerator, assert_same, run_ranks, setup, snapshot, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _save_then_change(rank: int, root: str) -> dict:
    import minifabric.checkpoint.service as service

    acc = accelerator(2)
    model, optimizer, scheduler = setup(acc)
    train(acc, model, optimizer, scheduler, 2)
    ema = torch.arange(6.0)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "ema": ema, "step": 2}
    expected = {"trained": snapshot(model, optimizer), "ema": ema.clone()}
    real = service.stage

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.5)
        return real(*args, **kwargs)

    service.stage = slow
    handle = acc.save(f"{root}/ckpt", state, asynchronous=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # SAM's first step / an update by hand
            p.clamp_(-0.25, 0.25)
    ema.mul_(0)
    train(acc, model, optimizer, scheduler, 1, seed=3)
    handle.wait()
    service.stage = real

    fresh, fresh_opt, fresh_sched = setup(acc, seed=9)
    loaded = {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "ema": None, "step": 0}
    acc.load(f"{root}/ckpt", loaded)
    return {"expected": expected, "loaded": {"trained": snapshot(fresh, fresh_opt), "ema": loaded["ema"]}}


def test_async_save_writes_the_state_at_the_call_on_every_rank(tmp_path: Path) -> None:
    for rank, out in enumerate(run_ranks(_save_then_change, 2, str(tmp_path), timeout=150)):
        assert_same(out["loaded"], out["expected"], f"rank {rank}")
