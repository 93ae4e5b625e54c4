"""Replaying a recipe: the value a meta tensor had in eager construction, computed on its build device.

:func:`evaluate` runs a base's creation and in-place ops on a real tensor on the device eager
construction would have built it on (the CPU, or the strategy's accelerator: ``Base.device``), with
the generator states recorded for them (:mod:`~minifabric.init.generators`), so the result is
bitwise the tensor eager construction produced. A value
read by an op (a :class:`~minifabric.init.recipe.Ref`) is the base's value at that point of the
recording; each such intermediate value is computed once per :func:`evaluate` call, so replay is
linear in the recorded ops (a spectral norm's power iterations read ``u`` and ``v`` back and forth).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from minifabric._torch import storage_key, tree_flatten, tree_map
from minifabric.init.generators import CPU, building_on, drawing_from, generator
from minifabric.init.recipe import TARGET, Base, Handle, Op, Real, Ref


def generators_of(op: Op) -> dict[str, torch.Generator]:
    """Fresh generators in the states ``op``'s explicit generators had before it ran."""
    return {
        name: generator(op.generator_devices.get(name, CPU), state) for name, state in op.generators.items()
    }


def call(
    op: Op,
    target: torch.Tensor | None,
    resolve: Callable[[Any], Any],
    generators: dict,
    device: torch.device = CPU,
) -> Any:
    """Run ``op`` on ``device`` (its build device) with ``target`` for its TARGET argument and its
    reads resolved by ``resolve``, drawing from the generator states recorded for it."""

    def fill(v: Any) -> Any:
        return target if v is TARGET else resolve(v)

    kwargs = tree_map(fill, op.kwargs)
    kwargs.update(generators)
    with torch.no_grad(), building_on(device), drawing_from(op.rng, op.device_rng, device):
        return op.func(*tree_map(fill, op.args), **kwargs)


def apply_chain(t: torch.Tensor, chain: tuple, resolve: Callable[[Any], Any]) -> torch.Tensor:
    """``t`` seen through a chain of view calls."""
    for func, args, kwargs, index in chain:
        fill = lambda v, t=t: t if v is TARGET else resolve(v)  # noqa: E731
        t = func(*tree_map(fill, args), **tree_map(fill, kwargs))
        if index is not None:
            t = t[index]
    return t


class _Replay:
    """One evaluation: intermediate values read by ops, each computed once."""

    def __init__(self) -> None:
        self._seen: dict[int, dict[int, torch.Tensor]] = {}  # id(base) -> op count -> value

    def resolve(self, ref: Any) -> Any:
        if isinstance(ref, Ref):
            return apply_chain(self.value(ref.handle.base, ref.seq), ref.handle.chain, self.resolve)
        if isinstance(ref, Real):
            return ref.tensor
        return ref

    def value(self, base: Base, upto: int | None = None) -> torch.Tensor:
        """``base`` after its ops numbered before ``upto`` (all of them when None); a fresh tensor."""
        count = len(base.ops) if upto is None else bisect.bisect_left([op.seq for op in base.ops], upto)
        seen = self._seen.setdefault(id(base), {})
        start = max((n for n in seen if n <= count), default=None)
        if start is not None:
            value = seen[start].clone()
        else:
            start, value = 0, self._create(base)
        with torch.no_grad():
            for op in base.ops[start:count]:
                target = apply_chain(value, op.target.chain, self.resolve)  # type: ignore[union-attr]
                call(op, target, self.resolve, generators_of(op), base.device)
        if upto is not None:  # a read: later reads of the same point start from here
            seen[count] = value.clone()
        return value

    def _create(self, base: Base) -> torch.Tensor:
        if base.origin == "value":
            return base.value.clone()  # type: ignore[union-attr]
        if base.origin == "empty":
            stride = base.stride or torch.empty(base.shape, device="meta").stride()
            return torch.empty_strided(base.shape, stride, dtype=base.dtype, device=base.device)
        creator: Any = base.creator
        result = call(creator, None, self.resolve, generators_of(creator), base.device)
        value = result if creator.index is None else result[creator.index]
        flat, _ = tree_flatten((creator.args, creator.kwargs))
        reads = [r.tensor for r in flat if isinstance(r, Real)]
        if any(storage_key(r) == storage_key(value) for r in reads):  # returned (a view of) its input
            value = value.clone()
        return value


def evaluate(base: Base, upto: int | None = None) -> torch.Tensor:
    """The value ``base`` had in eager construction: after all its ops, or those numbered before ``upto``.

    Returns a new tensor on ``base.device`` (with the strides eager construction gave it).
    """
    return _Replay().value(base, upto)


def resolver() -> Callable[[Any], Any]:
    """A function that turns a recorded read (Ref, Real, or a plain value) into its value."""
    return _Replay().resolve


def value_of(handle: Handle) -> torch.Tensor:
    """The full value eager construction gave the tensor ``handle`` stands for (a view of a base, or the base)."""
    value = evaluate(handle.base)
    return apply_chain(value, handle.chain, resolver()) if handle.chain else value
