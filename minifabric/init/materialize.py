"""Materialization at ``setup``: the driver that picks the mode and runs the stages in order.

Two modes for a whole model, chosen by whether it carries a record
(:func:`~minifabric.init.attach.has_init_records`):

- built under plain ``torch.device("meta")`` (no record): Lightning Fabric's path, storage and
  each module's ``reset_parameters()`` (:mod:`~minifabric.init.plain_meta`);
- built inside ``init_module(empty_init=True)``: eager construction's values, tensor by tensor, by
  the stages below (the strategy calls :func:`recorded_places` before sharding, so its errors are
  raised before any collective, and :func:`materialize` after).

The stages of the recorded mode, in order:

1. :mod:`~minifabric.init.places`: every meta tensor's recorded init, checked.
2. :mod:`~minifabric.init.kept`: the values kept at construction that are exactly this rank's part.
3. :mod:`~minifabric.init.place`: storage for DTensors' local parts.
4. per tensor, its full value: the kept one (:func:`~minifabric.init.kept.take_whole_kept`) or a
   replay of its recipe on its build device (:func:`~minifabric.init.replay.value_of`), shown to the
   self-check when one is on (``on_value``; then every value is replayed);
5. :func:`~minifabric.init.place.place`: the value where the meta tensor was (a DTensor keeps only
   this rank's part).

It is the one walk for every strategy: a parameter may be a plain tensor (one process, DDP) or a
DTensor with any placements on any mesh (FSDP's ``Shard(0)``, tensor parallel's
``Shard``/``Replicate``, the ``_StridedShard`` of FSDP over tensor parallel on a 2-D mesh). Random
init cannot run on the shards directly: torch's sharded random-number tracker does not run on the
CPU, so every rank would fill its part from the same stream. Only one tensor exists at full size at
a time, so the peak per rank is its shards plus the largest parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifabric.init.attach import forget_records
from minifabric.init.kept import kept_shards, take_whole_kept
from minifabric.init.place import allocate_dtensors, place
from minifabric.init.places import Place, recorded_places
from minifabric.init.plain_meta import reset_meta_modules
from minifabric.init.replay import value_of

#: Called with a tensor's qualified name and its full eager value, as each is computed.
OnValue = Callable[[str, torch.Tensor], None]


def places_to_materialize(module: nn.Module, device: torch.device | str) -> list[Place]:
    """Pick the mode: a model with no record is materialized now, as Lightning Fabric does; else its places.

    Returns the recorded places (:func:`recorded_places`) to hand to :func:`materialize` after any
    sharding; none for a model built under plain ``torch.device("meta")``, whose meta tensors got
    storage on ``device`` and each module's ``reset_parameters()`` here.
    """
    reset_meta_modules(module, device)  # does nothing for a model that carries a record
    return recorded_places(module)


def materialize(
    module: nn.Module,
    places: list[Place] | None = None,
    device: torch.device | str = "cpu",
    buffer_device: torch.device | str | None = None,
    on_value: OnValue | None = None,
) -> None:
    """Give every meta parameter and buffer of ``module`` storage and its eager-construction value.

    Works parameter by parameter for plain tensors and for DTensors of any placement on any mesh
    (see the module docstring). A plain meta tensor is replaced by a new one (tied weights stay one
    parameter). Real tensors are kept (a pretrained part loaded with
    ``load_state_dict(..., assign=True)`` into a meta-built model). No communication. The record
    attached to the model is dropped.

    Args:
        module: the model, after any sharding (``fully_shard``, ``parallelize_module``).
        places: :func:`recorded_places` taken before sharding (so errors were raised before any
            collective); taken now when None.
        device: where parameters are materialized (the CPU when FSDP offloads them).
        buffer_device: where buffers are materialized (default: ``device``).
        on_value: called with each tensor's qualified name and full value (the self-check).
    """
    places = recorded_places(module) if places is None else places
    buffer_device = device if buffer_device is None else buffer_device
    if not places:
        return
    shards = {} if on_value is not None else kept_shards(places)
    forget_records(module)  # the recording's weak references would stop the swap
    allocate_dtensors(module, shards, device, buffer_device)
    names = _qualified_names(module) if on_value is not None else {}
    # id of a tensor done -> its replacement (None: filled in place, or given its kept shard)
    replaced: dict[int, torch.Tensor | None] = {id(t): None for t in _tensors(places) if id(t) in shards}
    with torch.no_grad():
        for sub, name, is_param, handle in places:
            tensors: Any = sub._parameters if is_param else sub._buffers
            old = tensors[name]
            if id(old) not in replaced:  # tied weights: one parameter in several places
                full = take_whole_kept(old, handle) if on_value is None else None
                if full is None:
                    full = value_of(handle)
                    if on_value is not None:
                        on_value(names.get((id(sub), name), name), full)
                replaced[id(old)] = place(old, full, device if is_param else buffer_device)
            if replaced[id(old)] is not None:
                tensors[name] = replaced[id(old)]


def _tensors(places: list[Place]) -> list[Any]:
    return [(sub._parameters if is_param else sub._buffers)[name] for sub, name, is_param, _ in places]


def _qualified_names(module: nn.Module) -> dict[tuple[int, str], str]:
    names: dict[tuple[int, str], str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name in (*sub._parameters, *sub._buffers):
            names.setdefault((id(sub), name), f"{prefix}.{name}" if prefix else name)
    return names
