"""Under FSDP, an optimizer built before ``setup`` and not passed to it raises at step() on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed


def _stale_optimizer(rank: int) -> str:
    from minifabric import Accelerator

    acc = Accelerator(accelerator="cpu", devices=2, strategy="fsdp")
    acc.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model = acc.setup(model)  # sharding replaces the parameters; the optimizer is left behind
    acc.backward(model(torch.randn(4, 8)).sum())
    try:
        optimizer.step()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_stale_optimizer_raises_on_every_rank():
    results = run_distributed(_stale_optimizer, 2, timeout=120)
    assert len(results) == 2
    for message in results:
        assert "acc.setup(model, optimizer)" in message, message
