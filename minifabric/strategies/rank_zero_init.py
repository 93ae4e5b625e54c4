"""Every rank sets up rank 0's construction of a model, as DDP does, also where nothing broadcasts.

DDP broadcasts rank 0's weights when it wraps a model, so a script that seeds each rank differently
before building it (nanoGPT's ``torch.manual_seed(1337 + rank)``) still trains one model. FSDP2 and
meta-device init do not: each rank keeps its own slice of the weights it built, or replays the init
it recorded from its own generator states, and the sharded model silently mixes seeds (rows 0-47
from one, 48-95 from another). ``setup`` therefore compares, at small cost, what each rank built
with rank 0's, and on a difference makes every rank take rank 0's:

- :func:`adopt_rank_zero_init`: for a meta-built model, a digest of the generator states and real
  tensors its recorded init reads; on a difference rank 0's states are sent and replayed
  everywhere, so each rank materializes its part of rank 0's model.
- :func:`keep_rank_zero_tensors`: for real (eagerly built) parameters and buffers, three float64
  checksums per tensor (its sum, its norm and a position-weighted sum); on a difference rank 0's tensors are broadcast.

Both are collectives: every rank calls them at the same point of ``setup``. Each rank's digest is
all-gathered on the default group (a few bytes per rank) and every rank decides from that same
list, so all ranks take the same branch. Not from a rank's own view plus ``Strategy.any_rank``:
where the Accelerator adopted a process group (the script's ``init_process_group``, Ray Train, a
second Accelerator in the process) that flag is not communicated, rank 0 (comparing with itself)
went on, and another rank waited in a broadcast rank 0 never entered.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minifabric import collectives
from minifabric.init.states import adopt_inputs, digest, init_inputs


def adopt_rank_zero_init(places: list, rank: int) -> bool:
    """Make the recorded init of ``places`` replay rank 0's random draws on every rank.

    Returns whether this run's ranks had recorded different draws (and now replay rank 0's).

    Raises:
        ValueError: on every rank, when a rank's recording does not fit rank 0's (another model).
    """
    if _simulated():
        return False
    handles = [place[3] for place in places]
    inputs = init_inputs(handles)
    if _alike(collectives.all_gather_object(digest(inputs))):
        return False
    theirs = collectives.broadcast_object(inputs if rank == 0 else None, 0)
    error = None
    if rank != 0:
        try:
            adopt_inputs(handles, theirs)
        except ValueError as e:
            error = f"rank {rank}: {e}"
    errors = [e for e in collectives.all_gather_object(error) if e is not None]
    if errors:
        raise ValueError(errors[0])
    return True


def _alike(every_rank: list[Any]) -> bool:
    """Whether all ranks' entries (one all-gathered list, the same on every rank) equal rank 0's."""
    return all(entry == every_rank[0] for entry in every_rank)


def _simulated() -> bool:
    """Whether the ranks are simulated (``estimate_memory``'s fake process group): nothing to compare."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def _real_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers that hold values (not meta, not already sharded), once each."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    out = []
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if id(t) in seen or t.is_meta or isinstance(t, DTensor):
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Three float64 numbers per tensor, computed where it lives: its sum, its 2-norm, and the sum of
    its values weighted by position (sum and norm alone do not see a permutation, e.g. a ``randperm``
    buffer drawn from another seed). The weights are built in chunks: no full float64 copy."""
    rows = []
    with torch.no_grad():
        for t in tensors:
            x = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
            if not x.is_floating_point():
                x = x.double()
            rows.append(
                torch.stack(
                    [
                        x.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(x, dtype=torch.float64),
                        _positional_sum(x),
                    ]
                )
            )
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 3, dtype=torch.float64)


def _positional_sum(x: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """``sum(x[i] * (1 + i % 8191))`` over the flattened tensor, in float64, ``chunk`` elements at a time."""
    flat = x.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        weights = torch.arange(start, start + part.numel(), dtype=torch.float64, device=x.device)
        total += (part.double() * (weights.remainder_(8191).add_(1))).sum()
    return total


def keep_rank_zero_tensors(module: nn.Module, device: torch.device) -> bool:
    """Give every rank rank 0's real parameters and buffers where any rank's differ (before sharding).

    Returns whether they differed (and were broadcast).

    Raises:
        ValueError: on every rank, when the ranks' models have other tensors (names, shapes, dtypes).
    """
    if _simulated():
        return False
    named = _real_tensors(module)
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    values = _values_digest(_checksums([t for _, t in named]))
    every_rank = collectives.all_gather_object((_hash(layout), values))
    if not _alike([layout for layout, _ in every_rank]):
        differing = [r for r, (theirs, _) in enumerate(every_rank) if theirs != every_rank[0][0]]
        raise ValueError(
            f"The ranks built different models: {type(module).__name__} has other parameters or buffers"
            f" (names, shapes or dtypes) on rank {differing[0]} than on rank 0. Every rank must build the"
            " same model before `acc.setup(model)`."
        )
    if _alike(every_rank) and every_rank[0][1] is not None:
        return False
    with torch.no_grad():
        for _, t in named:
            local = t.detach()
            work = local.to(device).contiguous()
            dist.broadcast(work, src=0)
            if work.data_ptr() != local.data_ptr():
                local.copy_(work)
    return True


def _hash(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=16).hexdigest()


def _values_digest(checksums: torch.Tensor) -> str | None:
    """A digest of the checksums; None where one is NaN (no value to compare: rank 0's tensors are taken)."""
    numbers = checksums.flatten().tolist()
    if any(math.isnan(x) for x in numbers):
        return None
    return _hash([x.hex() for x in numbers])
