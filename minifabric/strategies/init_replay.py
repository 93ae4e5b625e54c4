"""What meta-device init records, and replaying it at full size on the CPU.

A tracked meta tensor is a :class:`Base`: how it was created (uninitialized, from a real value, or
computed by a call) and the in-place operations (:class:`Op`) applied to it since, each with the
generator state it ran with when it draws random numbers. :func:`evaluate` replays them on a real CPU tensor:
the result is bitwise the tensor eager construction produced. Recording is
:mod:`~minifabric.strategies.init_record`'s job.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

HANDLE_ATTR = "_minifabric_init"
#: Orders every recorded op and read, across models: a read sees the ops numbered before it.
SEQ = itertools.count()


@dataclass
class Base:
    """A tensor whose value is known only as a recipe: how it was created, then what was done to it."""

    shape: torch.Size
    dtype: torch.dtype
    origin: str  # "empty" | "value" | "computed"
    value: torch.Tensor | None = None  # origin "value": the real tensor it was created from
    creator: Op | None = None  # origin "computed": the call that produced it
    ops: list[Op] = field(default_factory=list)
    problem: str | None = None

    @property
    def written(self) -> bool:
        return self.origin != "empty" or bool(self.ops)


@dataclass(frozen=True)
class Handle:
    """A tracked tensor: a base seen through a chain of view operations (``(func, args, kwargs, index)``)."""

    base: Base
    chain: tuple = ()


@dataclass
class Op:
    func: Callable
    args: tuple
    kwargs: dict
    seq: int
    target: Handle | None = None  # in-place ops: what they write; None for a creation
    index: int | None = None  # a creation that returns several tensors: which one
    rng: torch.Tensor | None = None  # default CPU generator state before the op, if it draws
    generators: dict[str, torch.Tensor] = field(default_factory=dict)  # kwarg name -> generator state


class _Target:
    """Marks, in a recorded op's arguments, the tensor the op writes into."""


@dataclass(frozen=True)
class Ref:
    """A tracked tensor read by an op: its value as of op number ``seq``."""

    handle: Handle
    seq: int


@dataclass(frozen=True)
class Real:
    """A real tensor read by an op; replay refuses it if it changed in place since."""

    tensor: torch.Tensor
    version: int


TARGET = _Target()


def handle_of(t: Any) -> Handle | None:
    """The handle recorded for a tracked tensor, if any."""
    return getattr(t, HANDLE_ATTR, None) if isinstance(t, torch.Tensor) else None


def set_handle(t: torch.Tensor, handle: Handle) -> None:
    setattr(t, HANDLE_ATTR, handle)


@contextmanager
def rng_as(state: torch.Tensor | None) -> Iterator[None]:
    """Inside, the default CPU generator starts from ``state`` (if given); restored after."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        yield


def identity(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def storage_id(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return id(t)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def scratch_value(ref: Any) -> Any:
    if isinstance(ref, Ref):
        base = ref.handle.base
        return apply_chain(torch.zeros(base.shape, dtype=base.dtype), ref.handle.chain, scratch_value)
    return ref.tensor if isinstance(ref, Real) else ref


def apply_chain(t: torch.Tensor, chain: tuple, resolve: Callable[[Any], Any]) -> torch.Tensor:
    for func, args, kwargs, index in chain:
        fill = lambda v, t=t: t if v is TARGET else resolve(v)  # noqa: E731
        t = func(*tree_map(fill, args), **tree_map(fill, kwargs))
        if index is not None:
            t = t[index]
    return t


def call(op: Op, target: torch.Tensor | None, resolve: Callable[[Any], Any], generators: dict) -> Any:
    def fill(v: Any) -> Any:
        return target if v is TARGET else resolve(v)

    kwargs = tree_map(fill, op.kwargs)
    kwargs.update(generators)
    with torch.no_grad(), rng_as(op.rng):
        return op.func(*tree_map(fill, op.args), **kwargs)


# ---- replay -------------------------------------------------------------------------------------


def _resolve(ref: Any) -> Any:
    if isinstance(ref, Ref):
        return apply_chain(evaluate(ref.handle.base, ref.seq), ref.handle.chain, _resolve)
    if isinstance(ref, Real):
        if ref.tensor._version != ref.version:
            raise RuntimeError(
                "A tensor read while the model was built under `init_module(empty_init=True)` was"
                " changed in place afterwards, so its value at that time is lost. Build the model"
                " with `init_module(empty_init=False)`, or leave that tensor unchanged until `setup`."
            )
        return ref.tensor
    return ref


def _generators(op: Op) -> dict[str, torch.Generator]:
    out = {}
    for name, state in op.generators.items():
        gen = torch.Generator()
        gen.set_state(state)
        out[name] = gen
    return out


def evaluate(base: Base, upto: int | None = None) -> torch.Tensor:
    """The value ``base`` had in eager construction (after all its ops, or those before op ``upto``)."""
    if base.origin == "value":
        value = base.value.clone()  # type: ignore[union-attr]
    elif base.origin == "empty":
        value = torch.empty(base.shape, dtype=base.dtype)
    else:
        creator: Any = base.creator
        result = call(creator, None, _resolve, _generators(creator))
        value = result if creator.index is None else result[creator.index]
        if _shares_input(value, creator):  # a creation that returned (a view of) its input
            value = value.clone()
    with torch.no_grad():
        for op in base.ops:
            if upto is not None and op.seq >= upto:
                break
            target = apply_chain(value, op.target.chain, _resolve)  # type: ignore[union-attr]
            call(op, target, _resolve, _generators(op))
    return value


def _shares_input(value: torch.Tensor, op: Op) -> bool:
    flat, _ = tree_flatten((op.args, op.kwargs))
    return any(isinstance(r, Real) and storage_id(r.tensor) == storage_id(value) for r in flat)
