"""Walks over parameters that every layer shares: an optimizer's in ``param_groups`` order, and tied weights.

A bottom-layer module (it imports only torch), so the strategies, the checkpoint package and the
memory estimator share it without importing each other.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn
from torch.optim import Optimizer

__all__ = ["TensorPlace", "optimizer_parameters", "shared_tensors"]


def optimizer_parameters(optimizer: Optimizer) -> list[nn.Parameter]:
    """Every parameter of ``optimizer``, group by group (the order of its ``state_dict`` indices)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class TensorPlace(NamedTuple):
    """Where a module holds a tensor: its qualified name, the owning submodule and the attribute."""

    name: str
    module: nn.Module
    attr: str


def shared_tensors(module: nn.Module, *, buffers: bool = False) -> list[list[TensorPlace]]:
    """Groups of places under ``module`` that hold one tensor object (tied weights), the one finder.

    Every path is walked (``remove_duplicate=False``), so a submodule reached twice gives two places
    of the same owner; parameters come before buffers, each in ``state_dict`` walk order. Only
    tensors held in more than one place are returned.
    """
    places: dict[int, list[TensorPlace]] = {}
    for kind in ("_parameters", "_buffers") if buffers else ("_parameters",):
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for attr, tensor in getattr(sub, kind).items():
                if tensor is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    places.setdefault(id(tensor), []).append(TensorPlace(name, sub, attr))
    return [group for group in places.values() if len(group) > 1]
