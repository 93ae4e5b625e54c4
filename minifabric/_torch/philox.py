"""One range of a dense random fill on CUDA, drawn without the rest (Philox counter arithmetic).

ATen's CUDA kernels for ``normal_`` and ``uniform_`` (``distribution_nullary_kernel``) run ``S``
threads on a tensor of at least ``S`` elements, ``S = SMs x (max threads per SM // 256) x 256``.
Thread ``i`` reads Philox subsequence ``i``; each step of its counter gives ``u`` values (4; 2 for
float64), written to elements ``k*R + j*S + i`` (``j < u``) of round ``k``, where ``R = u*S``. A fill
of ``n`` elements takes ``ceil(n / R)`` rounds and moves its generator's offset by 4 per round. So
elements ``[a, b)`` of a fill are what a fill of its whole rounds ``a // R`` to ``ceil(b / R)`` gives
when it starts at the offset plus ``4 * (a // R)``: :func:`draw_range`.

That is how ATen's kernels are written, not an API. :func:`replay_is_exact` checks it on the device
at the first use of each op and dtype, against the dense draw; where it does not hold (another
torch, another GPU), :func:`draw_part` answers None and the caller draws the whole tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from minifabric import process
from minifabric._torch.init import storage_key

ENGINE_CALLS = 4  # offset steps per round (ATen's curand4_engine_calls)
BLOCK = 256  # threads per block of those kernels
#: an ATen op that fills a tensor, and its arguments after that tensor
Fill = tuple[Any, tuple, dict]

def _dense_ops() -> tuple[Any, ...]:
    return torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default


def dense_fill(calls: list[tuple[Any, tuple, dict]], target: torch.Tensor) -> Fill | None:
    """The fill of ``target``, if the ATen ``calls`` a call ran (the seeded-op probe's ``calls``) are
    exactly one ``normal_`` or ``uniform_`` of all of ``target``, from the default generator, with
    number arguments; else None. Its value then depends on nothing but those numbers and the
    generator's state, whatever Python function made the call (``kaiming_uniform_`` computes its
    bound from the shape: the bound is in the arguments)."""
    if len(calls) != 1:
        return None
    func, args, kwargs = calls[0]
    if func not in _dense_ops() or not args or not _same_layout(args[0], target):
        return None
    if kwargs.get("generator") is not None:
        return None
    rest = {k: v for k, v in kwargs.items() if k != "generator"}
    if any(isinstance(v, torch.Tensor) for v in tree_flatten((args[1:], rest))[0]):
        return None
    return func, tuple(args[1:]), rest


def _same_layout(a: Any, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and storage_key(a) == storage_key(b)
        and (a.shape, a.stride(), a.storage_offset(), a.dtype)
        == (b.shape, b.stride(), b.storage_offset(), b.dtype)
    )


def round_size(device: torch.device, dtype: torch.dtype) -> int:
    """``R``: the elements one round of a fill of at least ``S`` elements writes on ``device``."""
    props = torch.cuda.get_device_properties(device)
    threads = props.multi_processor_count * (props.max_threads_per_multi_processor // BLOCK) * BLOCK
    return threads * (2 if dtype == torch.float64 else 4)


def draw_range(
    fill_into: Callable[[torch.Tensor], Any],
    generator: Any,
    numel: int,
    start: int,
    end: int,
    size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Elements ``[start, end)`` of a fill of ``numel`` elements from ``generator``'s offset, drawn by
    ``fill_into`` as the whole rounds of ``size`` elements that hold them (a view of them); leaves the
    offset where the fill of all ``numel`` elements leaves it (where it was, if the draw raises)."""
    offset = generator.get_offset()
    first, last = start // size, -(-end // size)
    part = torch.empty(0, dtype=dtype, device=device)
    if end > start:
        rounds = torch.empty((last - first) * size, dtype=dtype, device=device)
        generator.set_offset(offset + ENGINE_CALLS * first)
        try:
            fill_into(rounds)
        except BaseException:
            generator.set_offset(offset)
            raise
        part = rounds[start - first * size : end - first * size]
    generator.set_offset(offset + ENGINE_CALLS * -(-numel // size))
    return part


def check_replay(
    fill_into: Callable[[torch.Tensor], Any],
    generator: Any,
    size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether :func:`draw_range` gives the dense fill's elements and end offset, on a fill of two
    rounds and a part (``fill_into`` draws from ``generator``): ranges that start and end inside a
    round, cross rounds, lie in the last partial round, and each rank's chunk at 3 and 8 parts."""
    numel = 2 * size + size // 3 + 5
    start_offset = generator.get_offset()
    dense = torch.empty(numel, dtype=dtype, device=device)
    fill_into(dense)
    end_offset = generator.get_offset()
    if end_offset != start_offset + ENGINE_CALLS * -(-numel // size):
        return False
    ranges = [(0, numel), (size // 2 + 1, 2 * size + 7), (size - 1, size + 1), (2 * size + 3, numel), (7, 7)]
    for parts in (3, 8):
        chunk = -(-numel // parts)
        ranges += [(min(i * chunk, numel), min((i + 1) * chunk, numel)) for i in range(parts)]
    for start, end in ranges:
        generator.set_offset(start_offset)
        part = draw_range(fill_into, generator, numel, start, end, size, dtype, device)
        if generator.get_offset() != end_offset or not torch.equal(part, dense[start:end]):
            return False
    return True


def replay_is_exact(device: torch.device, func: Any, dtype: torch.dtype) -> bool:
    """Whether a range of ``func`` (``normal_`` or ``uniform_``) in ``dtype`` on ``device`` draws what the
    dense fill draws there: :func:`check_replay` at the first use in the process, on a generator of
    its own (the default one is not moved). Warns once where it does not hold."""
    return process.fact(("philox-range-replay", device, func, dtype), lambda: _self_test(device, func, dtype))


def _self_test(device: torch.device, func: Any, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=device)
    gen.manual_seed(20261128)
    exact = check_replay(lambda t: func(t, generator=gen), gen, round_size(device, dtype), dtype, device)
    if not exact:
        warnings.warn(
            f"minifabric: drawing a rank's rows alone does not give the dense draw of `{func}` in "
            f"{dtype} on {device} (this torch's kernels differ from the Philox round arithmetic); "
            "meta init draws whole tensors there instead (exact, slower).",
            stacklevel=4,
        )
    return exact


def draw_part(
    fill: Fill, numel: int, dtype: torch.dtype, device: torch.device, start: int, end: int
) -> torch.Tensor | None:
    """Elements ``[start, end)`` of ``fill`` over a new tensor of ``numel`` elements on ``device``, drawn
    alone from the device's default generator, which is left where the whole fill leaves it (a
    view). None where that is not known to be exact, or saves nothing: not CUDA, the whole tensor,
    a tensor of at most one round, one whose rounds take 2 GiB or more (ATen fills a tensor over
    ``2**31 - 1`` bytes as several fills, one per 32-bit-indexable piece, each from an offset of its
    own), a self-test that failed."""
    if device.type != "cuda" or end - start >= numel:
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    func, args, kwargs = fill
    size = round_size(device, dtype)
    rounds = -(-numel // size) * size  # all the fill's rounds: no fewer elements than the tensor or any range
    if numel <= size or rounds * dtype.itemsize >= 2**31 or not replay_is_exact(device, func, dtype):
        return None
    generator = torch.cuda.default_generators[device.index]
    return draw_range(lambda t: func(t, *args, **kwargs), generator, numel, start, end, size, dtype, device)
