"""Stage 2 of ``setup``'s materialization: values kept at construction, used instead of a replay.

``init_module(empty_init=True)`` may keep, from the first random write of each parameter, the
part of the value this rank will hold after ``setup`` (``Base.kept``: chunk ``index`` of ``parts``
along dim 0). Where the tensor's placement is exactly that part, ``setup`` uses it and does not
run the init a second time; anywhere else the recipe is replayed. A kept part is used once (the
base forgets it), so two models never share storage.
"""

from __future__ import annotations

from typing import Any

import torch

from minifabric.init.places import Place
from minifabric.init.recipe import Handle, is_dtensor


def kept_shards(places: list[Place]) -> dict[int, torch.Tensor]:
    """id of a meta DTensor -> the part of its value kept at construction, where that is its shard.

    A DTensor holds chunk ``index`` of ``parts`` along dim 0 only under ``Shard(0)`` over a mesh dim
    of ``parts`` ranks where it is rank ``index``, replicated over any other dims before it (FSDP;
    HSDP's ``(Replicate(), Shard(0))``); anything else is replayed.
    """
    out: dict[int, torch.Tensor] = {}
    for sub, name, is_param, handle in places:
        old: Any = (sub._parameters if is_param else sub._buffers)[name]
        kept = handle.base.kept
        if kept is None or handle.chain or not is_dtensor(old) or id(old) in out:
            continue
        from torch.distributed.tensor import Replicate, Shard

        (parts, index), part = kept
        mesh, (*outer, last) = old.device_mesh, old.placements
        if (
            all(p == Replicate() for p in outer)
            and last == Shard(0)
            and (mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)) == (parts, index)
            and tuple(old._local_tensor.shape) == tuple(part.shape)
        ):
            out[id(old)] = part
            handle.base.kept = None
    return out


def take_whole_kept(old: torch.Tensor, handle: Handle) -> torch.Tensor | None:
    """A plain tensor's whole value, kept at construction (part ``(1, 0)``); None where there is none."""
    kept = handle.base.kept
    if kept is None or handle.chain or is_dtensor(old):
        return None
    (parts, index), part = kept
    if (parts, index) != (1, 0) or part.shape != old.shape:
        return None
    handle.base.kept = None
    return part
