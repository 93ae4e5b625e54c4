"""The recipe of a meta tensor: how eager construction would have computed its value.

A tracked meta tensor is a :class:`Base`: how it was created (uninitialized, from a real value, or
computed by a call) and the in-place operations (:class:`Op`) applied to it since, each with the
generator states it ran with when it draws random numbers. A tensor seen through views of a base
is a :class:`Handle` (the base and the chain of view calls). Ops refer to what they read as
:class:`Ref` (a tracked tensor as of a point of the recording) or :class:`Real` (a real tensor,
copied when it was read).

Which tensor has which handle is kept on the model that was built: see
:mod:`~minifabric.init.attach`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class Base:
    """A tensor whose value is known only as a recipe: how it was created, then what was done to it."""

    shape: torch.Size
    dtype: torch.dtype
    origin: str  # "empty" | "value" | "computed"
    stride: tuple[int, ...] | None = None  # origin "empty": the strides it was created with
    value: torch.Tensor | None = None  # origin "value": the real tensor it was created from
    creator: Op | None = None  # origin "computed": the call that produced it
    ops: list[Op] = field(default_factory=list)
    problem: str | None = None  # why its value cannot be reproduced (raised at setup)
    #: ((parts, index), chunk ``index`` of the value along dim 0), kept from construction (see Draws._keep)
    kept: tuple[tuple[int, int], torch.Tensor] | None = None
    #: where eager construction computes its value (the build device; see :mod:`~minifabric.init.generators`)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def written(self) -> bool:
        """Whether anything gave it a value (an uninitialized tensor never written has none)."""
        return self.origin != "empty" or bool(self.ops)


@dataclass(frozen=True, eq=False)
class Handle:
    """A tracked tensor: a base seen through a chain of view calls (``(func, args, kwargs, index)``)."""

    base: Base
    chain: tuple = ()


@dataclass(eq=False)
class Op:
    """One recorded call: an in-place write into ``target``, or the creation of a base."""

    func: Callable
    args: tuple
    kwargs: dict
    seq: int
    name: str = ""  # how messages name the call
    target: Handle | None = None  # in-place ops: what they write; None for a creation
    index: int | None = None  # a creation that returns several tensors: which one
    rng: torch.Tensor | None = None  # default CPU generator state before the op, if it draws
    device_rng: torch.Tensor | None = None  # the build device's default generator state before it, if it draws
    generators: dict[str, torch.Tensor] = field(default_factory=dict)  # kwarg name -> generator state
    generator_devices: dict[str, torch.device] = field(default_factory=dict)  # kwarg name -> its device

    @property
    def draws(self) -> bool:
        """Whether it draws random numbers (from a default generator, or one it is given)."""
        return self.rng is not None or self.device_rng is not None or bool(self.generators)


@dataclass(frozen=True)
class _Target:
    """Marks, in a recorded op's arguments, the tensor the op writes into."""

    def __repr__(self) -> str:
        return "TARGET"


TARGET = _Target()


@dataclass(frozen=True, eq=False)
class Ref:
    """A tracked tensor read by an op: its value as of op number ``seq``."""

    handle: Handle
    seq: int


@dataclass(frozen=True, eq=False)
class Real:
    """A real tensor read by an op: a copy taken at the read, so later changes do not reach replay."""

    tensor: torch.Tensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``: if it is not
    imported, no DTensor exists)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    return tensor_module is not None and isinstance(t, tensor_module.DTensor)
