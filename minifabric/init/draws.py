"""Running a recorded call for real on the build device, so the random streams move as in eager construction.

The recorder (:mod:`~minifabric.init.record`) runs each call that draws random numbers once, for
real: an in-place init on a scratch tensor of its target's shape, strides and dtype (memory reused
from call to call), a call with no meta kernel on the real values it reads. :class:`Draws` keeps on
the op the generator states it started from (only those it moved: the CPU's, the build device's,
an explicit ``generator=``), which replay restores, and keeps this rank's part of the first value
an uninitialized tensor gets (``keep``), which ``setup`` then copies instead of drawing again.
"""

from __future__ import annotations

from typing import Any

import torch

from minifabric._torch import dense_fill, draw_part
from minifabric.init.generators import advanced, same_device, states
from minifabric.init.recipe import Base, Op
from minifabric.init.replay import apply_chain, call, resolver


class Draws:
    """The real runs of one recording: on ``device`` (the build device), with the parts it keeps.

    Args:
        device: the build device (where eager construction runs the calls).
        keep: ``(parts, index)``: keep chunk ``index`` of ``parts`` along dim 0 of each first value
            (see :func:`~minifabric.init.context.meta_init_context`); None keeps nothing.
        keep_on: where the kept parts wait for ``setup`` (where the parameters will live).
    """

    def __init__(self, device: torch.device, keep: tuple[int, int] | None, keep_on: torch.device) -> None:
        self.device, self.keep, self.keep_on = device, keep, keep_on
        self._scratch_bytes: torch.Tensor | None = None  # reused: page-faulted once, not per parameter

    def run(self, op: Op, target: torch.Tensor | None = None, device: torch.device | None = None) -> Any:
        """Run ``op`` for real on ``device`` (default: the build device) with ``target`` for its TARGET;
        note on it the generator states it started from, of the streams it moved. Returns its result."""
        gens = {k: v for k, v in op.kwargs.items() if isinstance(v, torch.Generator)}
        given = {k: g.get_state() for k, g in gens.items()}
        before = states(self.device)
        result = call(op, target, resolver(), dict(gens), self.device if device is None else device)
        op.rng, op.device_rng = advanced(before, self.device)
        op.generators = {k: s for k, s in given.items() if not torch.equal(s, gens[k].get_state())}
        op.generator_devices = {k: gens[k].device for k in op.generators}
        return result

    def advance(self, op: Op, calls: list | None = None, target: torch.Tensor | None = None) -> None:
        """Run a random ``op`` for real on a scratch target (a creation: on nothing), where eager
        construction runs it; keep this rank's part of a first value. ``calls``: the ATen ops the op
        ran on its meta ``target`` (the seeded-op probe's), where known: a dense fill of all of it
        may be drawn in part (:meth:`_draw_part`)."""
        if op.target is None:
            self.run(op)
            return
        base = op.target.base
        stride = base.stride or torch.empty(base.shape, device="meta").stride()
        fill = dense_fill(calls, target) if calls and target is not None else None
        if fill is not None and not op.target.chain and not base.ops and self._draw_part(op, fill, base, stride):
            return
        scratch = apply_chain(self._scratch(base.shape, stride, base.dtype, base.device), op.target.chain, resolver())
        self.run(op, scratch, base.device)
        if not op.target.chain and not base.ops:
            self._keep(base, scratch)

    def _draw_part(self, op: Op, fill: tuple, base: Base, stride: tuple[int, ...]) -> bool:
        """Keep this rank's rows of the first write of an uninitialized base without drawing the other
        ranks' rows, where that is exact: a dense ``normal_``/``uniform_`` fill of all of a contiguous
        tensor on CUDA (:func:`minifabric._torch.philox.draw_part`). False where it does not apply."""
        if self.keep is None or self.keep[0] == 1 or base.origin != "empty" or not base.shape:
            return False
        if not same_device(base.device, self.device) or stride != torch.empty(base.shape, device="meta").stride():
            return False
        lo, hi = rows_of(base.shape[0], *self.keep)
        row = base.shape[1:].numel()
        before = states(self.device)
        part = draw_part(fill, base.shape.numel(), base.dtype, self.device, lo * row, hi * row)
        if part is None:
            return False
        op.rng, op.device_rng = advanced(before, self.device)
        self._hold(base, part.view(hi - lo, *base.shape[1:]))
        return True

    def _scratch(
        self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``stride`` on ``device``, in memory reused from call
        to call on the build device."""
        if device != self.device:  # a tensor eager construction holds elsewhere (a CPU one in a CUDA block)
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
        nbytes = size * dtype.itemsize
        if self._scratch_bytes is None or self._scratch_bytes.numel() < nbytes:
            self._scratch_bytes = None
            self._scratch_bytes = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self._scratch_bytes[:nbytes].view(dtype).as_strided(shape, stride)

    def release(self) -> None:
        """Free the scratch memory (at the end of the context)."""
        self._scratch_bytes = None

    def _keep(self, base: Base, value: torch.Tensor) -> None:
        """Keep this rank's part of the value the first write of an uninitialized base computed.

        ``keep`` is ``(parts, index)``: the part ``setup`` will place on this rank is chunk ``index``
        of ``parts`` along dim 0 (``(1, 0)``: all of it). Replay at ``setup`` then only copies it,
        instead of running the (random) op a second time; ``setup`` uses it only where the
        parameter's placement is exactly that chunk, and replays otherwise.
        """
        if self.keep is None or base.origin != "empty" or value.dim() == 0:
            return
        lo, hi = rows_of(value.shape[0], *self.keep)
        self._hold(base, value[lo:hi])

    def _hold(self, base: Base, part: torch.Tensor) -> None:
        """Keep a copy of ``part`` (this rank's rows of ``base``'s first value) where ``setup`` wants it."""
        base.kept = (self.keep, part.to(self.keep_on, copy=True))


def rows_of(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of chunk ``index`` of ``parts`` along dim 0 of ``rows`` rows, as
    ``torch.chunk`` (and FSDP's ``Shard(0)``) cut them: chunks of ``ceil(rows / parts)``, the last ones
    shorter or empty."""
    size = -(-rows // parts)
    lo = min(index * size, rows)
    return lo, min(lo + size, rows)
