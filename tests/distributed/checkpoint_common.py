"""Tiny models and helpers shared by the checkpoint tests (run inside spawned ranks)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric import Accelerator
from tests.helpers import run_distributed


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """:func:`tests.helpers.run_distributed` with the shorter timeout of the checkpoint tests."""
    return run_distributed(fn, world_size, *args, timeout=timeout)


class Net(nn.Module):
    """Two blocks with dropout; 5 rows in the first layer so the shards of 2 and 4 ranks are uneven."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, 5), nn.Linear(5, width)])
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.blocks[0](x)))
        return self.head(torch.relu(self.blocks[1](x)))


def accelerator(world_size: int, state_dict_type: str = "sharded") -> Accelerator:
    """A launched accelerator; ``fsdp`` on several ranks, ``single`` on one."""
    strategy = "fsdp" if world_size > 1 else "single"
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=world_size)
    acc.launch()
    acc.strategy.state_dict_type = state_dict_type
    return acc


def setup(acc: Accelerator, seed: int = 0, lr: float = 0.05) -> tuple[Any, Any, Any]:
    """A seeded ``Net`` with AdamW and a StepLR scheduler, set up by ``acc``."""
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return acc.setup(model, optimizer, scheduler=scheduler)


def train(
    acc: Accelerator, model: Any, optimizer: Any, scheduler: Any | None, steps: int, seed: int = 1
) -> None:
    """A few optimizer steps on random data (the same data on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator)
        acc.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def full(value: Any) -> Any:
    """``value`` with every DTensor gathered into a full CPU tensor (collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def snapshot(model: Any, optimizer: Any) -> dict[str, Any]:
    """Full model weights and optimizer state, comparable across world sizes."""
    return {"model": full(model.state_dict()), "optimizer": full(optimizer.state_dict())}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested containers of tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def committed_digest(path: Path) -> dict[str, str]:
    """sha256 of what a checkpoint at ``path`` loads from: the pointer and the version it names."""
    from minifabric.checkpoint.commit import locate

    version = locate(path)
    return {"pointer": version.name, **tree_digest(version)}


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (a checkpoint folder), by relative name."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }
