"""A meta-built model whose init arguments come from Python's ``random`` under per-rank seeds.

``acc.seed_everything(1337 + rank)`` seeds torch, numpy and Python's ``random``. An init that reads a
drawn Python number (``normal_(w, std=random.uniform(...))``) records it as an argument, not as a
generator state: replaying rank 0's states with this rank's arguments would give each rank's slice
another model. Setup must give every rank rank 0's model, or raise on every rank.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.init_styles import mismatches

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class RandomStd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        for layer in (self.a, self.b):
            nn.init.normal_(layer.weight, std=random.uniform(0.01, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def python_random_per_rank(rank: int, world_size: int) -> str | list[str]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    acc.seed_everything(1337)
    rank_zero_model = RandomStd()
    acc.seed_everything(1337 + rank)
    with acc.init_module(empty_init=True):
        model = RandomStd()
    try:
        model = acc.setup(model)
    except ValueError as e:
        return str(e)
    return mismatches(rank_zero_model, model)


def test_python_random_init_arguments_under_per_rank_seeds() -> None:
    results = run_distributed(python_random_per_rank, 2, 2, timeout=240)
    errors = [r for r in results if isinstance(r, str)]
    assert results == [[]] * 2 or (len(errors) == 2 and all("argument" in e for e in errors)), results
