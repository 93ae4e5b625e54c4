"""Gradient norms and clipping over sharded (DTensor) gradients.

Each rank reduces its local shards to one number, and one all-reduce over the mesh dimensions the
gradients are sharded on combines them: the result is the norm one process would compute over the
full gradients. Empty local shards (a parameter with fewer rows than ranks) are skipped rather
than reduced, which is what makes ``norm_type=inf`` hang in torch's own ``clip_grad_norm_``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sharded_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups along which ``grad`` is split (none for a plain or replicated tensor).

    Every placement other than ``Replicate`` splits the tensor: ``Shard`` and the ``_StridedShard``
    that FSDP puts on the data-parallel dimension of a tensor-parallel parameter (which is not a
    ``Shard`` subclass). A ``Partial`` gradient (unreduced sums) has no norm yet: that raises.
    """
    if not isinstance(grad, DTensor):
        return ()
    mesh = grad.device_mesh
    if any(p.is_partial() for p in grad.placements):
        raise RuntimeError(
            f"A gradient has placements {grad.placements} on mesh {mesh.mesh_dim_names}: a Partial gradient is"
            " a sum not yet reduced, so its norm cannot be taken. Give the parameter a Replicate or Shard"
            " placement in your parallelize_fn (e.g. `SequenceParallel()` for a norm layer)."
        )
    return tuple(mesh.get_group(dim) for dim, p in enumerate(grad.placements) if not p.is_replicate())


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` together, as a plain float32 tensor on every rank."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type={norm_type!r} must be positive or inf, e.g. `norm_type=2.0`.")
    is_inf = math.isinf(norm_type)
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        # Every rank must join the same all-reduces, so a group is kept even if its shards are empty here.
        by_groups[_sharded_groups(grad)].append(_local(grad))
    device = _local(grads[0]).device if grads else torch.device("cpu")
    partials = []
    for groups, tensors in by_groups.items():
        norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in tensors if t.numel()]
        stacked = torch.stack(norms) if norms else torch.zeros(1, device=device)
        value = stacked.max() if is_inf else stacked.pow(norm_type).sum()
        for group in groups:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        partials.append(value)
    if not partials:
        return torch.zeros((), device=device)
    stacked = torch.stack(partials).to(device)
    return stacked.max() if is_inf else stacked.sum().pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients so that their total norm is at most ``max_norm``; return the norm before.

    Like ``torch.nn.utils.clip_grad_norm_``, but the returned norm is a plain tensor equal on every
    rank to the single-process norm, and it never hangs on empty shards. The norm is the same on
    every rank, so with ``error_if_nonfinite`` every rank raises together.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it"
            " cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway,"
            " set `error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local = _local(grad)
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return norm
