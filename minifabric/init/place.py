"""Stage 3 of ``setup``'s materialization: storage for the meta tensors, then each full value in place.

A DTensor of any placement on any mesh keeps its ``Parameter`` object (FSDP2 re-points its shards
at the new storage): :func:`allocate_dtensors` gives it storage for its local part only, and
:func:`fill_local` copies this rank's part of the full value into it, cut locally by the DTensor's
own placement rules (``distribute_tensor(..., src_data_rank=None)``, no communication). A plain
meta tensor is replaced by a new tensor (:func:`place` returns it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifabric._torch import swap_module_tensors
from minifabric.init.recipe import is_dtensor


def allocate_dtensors(
    module: nn.Module, shards: dict[int, torch.Tensor], device: Any, buffer_device: Any
) -> None:
    """Give each meta DTensor of ``module`` storage for its local part (``shards[id]`` where given)."""

    def allocate(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_meta and is_dtensor(t)):
            return t
        target = device if isinstance(t, nn.Parameter) else buffer_device
        if id(t) in shards:  # a kept part that is exactly this rank's shard: its storage, no second copy
            placed: Any = t
            local = shards[id(t)].to(device=target, dtype=t.dtype)
            return shard_from_local(local, placed.device_mesh, placed.placements, t.shape, t.stride())
        return torch.empty_like(t, device=target)

    if any(is_dtensor(t) and t.is_meta for t in (*module.parameters(), *module.buffers())):
        swap_module_tensors(module, allocate)


def place(old: torch.Tensor, full: torch.Tensor, device: Any) -> torch.Tensor | None:
    """A plain meta tensor: its replacement on ``device``. A DTensor: its local part filled in place (None)."""
    if is_dtensor(old):
        fill_local(old, full.to(old.dtype))
        return None
    value = full.to(device=device, dtype=old.dtype)
    return type(old)(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value


def fill_local(tensor: Any, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into the local tensor of ``tensor`` (a DTensor of any placement)."""
    from torch.distributed.tensor import distribute_tensor

    if not full.numel():  # no values to place (FSDP gives such a parameter a local part of its own shape)
        return
    part = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()

    def mismatch(here: tuple, given: tuple) -> RuntimeError:
        return RuntimeError(
            f"A parameter of shape {tuple(full.shape)} placed as {tensor.placements} has a local part of"
            f" shape {here}, but its placements give {given}: materialize it"
            " before changing its local tensor."
        )

    copy_into_local(tensor, part, mismatch)


def shard_from_local(local: torch.Tensor, mesh: Any, placements: Any, shape: Any, stride: Any) -> Any:
    """A DTensor over ``local``, this rank's part of a tensor of global ``shape`` and ``stride``.

    No communication: the global layout is given, not checked (``run_check=False``).
    """
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def copy_into_local(
    tensor: torch.Tensor, part: torch.Tensor, mismatch: Callable[[tuple, tuple], Exception]
) -> None:
    """Copy ``part`` into this rank's part of ``tensor`` (its local tensor if a DTensor; else itself).

    Raises ``mismatch(shape here, shape of part)`` when the two shapes differ, before any write.
    """
    local = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    if local.shape != part.shape:
        raise mismatch(tuple(local.shape), tuple(part.shape))
    local.copy_(part)
