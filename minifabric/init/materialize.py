"""Materialization at ``setup``: every recorded meta tensor gets its eager-construction value.

:func:`recorded_places` checks, before anything is changed (and so before any collective), that
every meta tensor of a model has a replayable record. :func:`materialize` then gives each meta
tensor storage and its value, one tensor at a time, and leaves real tensors alone (a pretrained
part loaded with ``load_state_dict(..., assign=True)`` into a meta-built model is kept).

It is the one walk for every strategy: a parameter may be a plain tensor (one process, DDP) or a
DTensor with any placements on any mesh (FSDP's ``Shard(0)``, tensor parallel's
``Shard``/``Replicate``, the ``_StridedShard`` of FSDP over tensor parallel on a 2-D mesh). Its full
value is computed on the CPU (:func:`~minifabric.init.replay.evaluate`), then cut to this rank's
part with ``distribute_tensor(..., src_data_rank=None)``, which splits locally, without
communication, by the DTensor's own placement rules. Random init cannot run on the shards
directly: torch's sharded random-number tracker does not run on the CPU, so every rank would fill
its part from the same stream. Only one tensor exists at full size at a time, so the peak per rank
is its shards plus the largest parameter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifabric._torch import swap_module_tensors, tensor_version
from minifabric.init.recipe import (
    SEALED,
    Handle,
    Real,
    Ref,
    forget_records,
    handle_of,
    is_dtensor,
    module_record,
)
from minifabric.init.replay import apply_chain, evaluate, resolver

#: (module, attribute name, is a parameter, recorded init) for every meta tensor of a model.
Place = tuple[nn.Module, str, bool, Handle]
#: Called with a tensor's qualified name and its full eager value, as each is computed.
OnValue = Callable[[str, torch.Tensor], None]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` still lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def has_init_records(module: nn.Module) -> bool:
    """Whether ``module`` was built (in part) inside ``init_module(empty_init=True)``."""
    return any(module_record(sub) for sub in module.modules()) or any(
        handle_of(t) is not None for t in (*module.parameters(), *module.buffers())
    )


def _handle_at(sub: nn.Module, name: str, t: torch.Tensor) -> Handle | None:
    handle = handle_of(t)
    if handle is None:
        record: dict[str, Handle] = module_record(sub) or {}
        handle = record.get(name)
        if handle is not None and _shape(handle) != t.shape:
            return None
    return handle


def _shape(handle: Handle) -> torch.Size:
    if not handle.chain:
        return handle.base.shape
    meta = torch.empty(handle.base.shape, dtype=handle.base.dtype, device="meta")
    return apply_chain(meta, handle.chain, lambda v: _meta_value(v)).shape


def _meta_value(v: Any) -> Any:
    if isinstance(v, Ref):
        return torch.empty(_shape(v.handle), dtype=v.handle.base.dtype, device="meta")
    return v.tensor if isinstance(v, Real) else v


def recorded_places(module: nn.Module, rebuilt_by: str | None = None) -> list[Place]:
    """Every meta parameter and buffer of ``module`` with its recorded init.

    A parameter with no elements that nothing wrote has its one possible value (DINOv3's default of
    no register tokens): it is set up, not refused as uninitialized memory.

    Args:
        module: the model.
        rebuilt_by: how messages name user code that rebuilt modules since construction (a
            ``parallelize_fn``), for a meta tensor it put there with no record.

    Raises:
        ValueError: a meta tensor whose init cannot be reproduced (named, with the fix), before
            anything is changed: call it on every rank before any collective.
    """
    places: list[Place] = []
    root = _class_name(module)
    for prefix, sub in module.named_modules():
        _refuse_reset_set_after(prefix, sub, root)
        for is_param, tensors in ((True, sub._parameters), (False, sub._buffers)):
            for name, t in tensors.items():
                if t is None or not t.is_meta:
                    continue
                label = f"{'parameter' if is_param else 'buffer'} {f'{prefix}.{name}' if prefix else name!r}"
                where = f"{label} of {root} (in {_class_name(sub)})"
                handle = _handle_at(sub, name, t)
                if handle is None and rebuilt_by is not None:
                    raise ValueError(_unknown_after(where, rebuilt_by))
                if handle is None:
                    raise ValueError(
                        f"The {where} is on the meta device but was not created inside"
                        " `acc.init_module(empty_init=True)`, so its init is unknown. Build the whole model"
                        " inside it: `with acc.init_module(empty_init=True): model = Model()`."
                    )
                sealed = SEALED.get(t)
                if sealed is not None and tensor_version(t) != sealed:
                    raise ValueError(_changed_after(prefix, name, where))
                if rebuilt_by is not None and handle_of(t) is None and tensor_version(t):
                    # made inside that code (its `fully_shard`, a `copy.deepcopy`), then written there
                    raise ValueError(
                        f"The {where} was changed in place by {rebuilt_by}, which made it (its own"
                        " `fully_shard`) from a meta-built one: on the meta device the write does nothing and"
                        " is not recorded, so `setup` cannot reproduce it. Move the init into the"
                        " `init_module(empty_init=True)` block, right after constructing the model, or build it"
                        " with `acc.init_module(empty_init=False)`."
                    )
                base = handle.base
                if base.problem is not None:
                    raise ValueError(
                        f"The init of the {where} cannot be reproduced after `init_module(empty_init=True)`:"
                        f" {base.problem}. Initialize it with `torch.nn.init` functions or in-place ops"
                        " on the parameter (e.g. `torch.nn.init.normal_(self.weight, std=0.02)`), or build this"
                        " model with `acc.init_module(empty_init=False)`."
                    )
                if is_param and not base.written and t.numel():
                    made = "`torch.empty`" if not handle.chain else "a view of `torch.empty`"
                    raise ValueError(
                        f"The {where} is created with {made} (or `new_empty`/`empty_like`) and never"
                        " initialized in `__init__`: eager construction leaves it as uninitialized memory,"
                        f" so there is no value to reproduce. Initialize it in `{_class_name(sub)}.__init__`,"
                        f" e.g. `torch.nn.init.normal_(self.{name}, std=0.02)`, or call"
                        " `self.reset_parameters()` (or the root's `self.init_weights()`) at the end of"
                        " `__init__`."
                    )
                places.append((sub, name, is_param, handle))
    return places


def _class_name(module: nn.Module) -> str:
    """The module's own class name: ``fully_shard`` makes ``FSDP<Name>``, a subclass of it, which users never wrote."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = type(module)
    if fsdp is not None and cls.__bases__[:1] == (fsdp.FSDPModule,) and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls.__name__


def _refuse_reset_set_after(prefix: str, sub: nn.Module, root: str) -> None:
    """A ``reset_parameters`` set on a meta-built module after its ``init_module`` block ended.

    Lightning Fabric's FSDP calls it when it materializes the model (litgpt's ``pretrain.py`` relies
    on that); ``setup`` here gives the weights of eager construction and would silently ignore it.
    """
    record = module_record(sub)
    if record is None or record.own_reset is not False or "reset_parameters" not in sub.__dict__:
        return
    if not any(t.is_meta for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None):
        return
    where = f"`{prefix}.reset_parameters`" if prefix else "`reset_parameters`"
    raise ValueError(
        f"{where} of {root} (in {_class_name(sub)}) was set after `init_module(empty_init=True)` ended."
        " Lightning Fabric calls it when FSDP materializes the model; `setup` here gives the weights of"
        " eager construction and never calls it. Call the init inside the block, right after"
        " constructing the model: `with acc.init_module(empty_init=True): model = Model();"
        " init_weights(model)` (e.g. set the `reset_parameters` there and call each one), or build it"
        " with `acc.init_module(empty_init=False)`."
    )


def _unknown_after(where: str, rebuilt_by: str) -> str:
    return (
        f"The {where} is on the meta device with no recorded init after {rebuilt_by} ran: that code put it"
        " there (e.g. a module it built on the meta device that did not take over the original"
        " `Parameter` objects, or a DTensor it made by hand with `distribute_tensor`), so its value is"
        " unknown and `setup` would leave it uninitialized. Let the new module take over the old one's"
        " parameters and buffers, as torchao's `from_float` does (`new.weight = old.weight`), lay"
        " parameters out with `parallelize_module` or `distribute_module`, or build the model with"
        " `acc.init_module(empty_init=False)`."
    )


def _changed_after(prefix: str, name: str, where: str) -> str:
    qualified = f"{prefix}.{name}" if prefix else name
    return (
        f"The {where} was changed in place after `init_module(empty_init=True)` ended (e.g."
        f" `nn.init.normal_(model.{qualified})` or a `reset_parameters()` call between the block and"
        " `setup`). It is still on the meta device, where that write does nothing and is not recorded, so"
        " `setup` cannot reproduce it. Move the init into the block, right after constructing the model:"
        " `with acc.init_module(empty_init=True): model = Model(); init_weights(model)`; or build it with"
        " `acc.init_module(empty_init=False)`. To load weights into a meta-built model, use"
        " `model.load_state_dict(state, assign=True)`."
    )


def _value(handle: Handle) -> torch.Tensor:
    value = evaluate(handle.base)
    return apply_chain(value, handle.chain, resolver()) if handle.chain else value


def materialize(
    module: nn.Module,
    places: list[Place] | None = None,
    device: torch.device | str = "cpu",
    buffer_device: torch.device | str | None = None,
    on_value: OnValue | None = None,
) -> None:
    """Give every meta parameter and buffer of ``module`` storage and its eager-construction value.

    Works parameter by parameter for plain tensors and for DTensors of any placement on any mesh:
    a DTensor gets storage for its local part only, filled with this rank's part of the full value
    (see the module docstring); its ``Parameter`` object is kept (FSDP2 re-points its shards at the
    new storage). A plain meta tensor is replaced by a new one (tied weights stay one parameter).
    Real tensors are kept. No communication.

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

    # A kept part that is exactly this rank's shard becomes the shard's storage: no second copy.
    shards = {} if on_value is not None else _kept_shards(places)

    def allocate(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_meta and is_dtensor(t)):
            return t
        target = device if isinstance(t, nn.Parameter) else buffer_device
        if id(t) in shards:
            from torch.distributed.tensor import DTensor

            local = shards[id(t)].to(device=target, dtype=t.dtype)
            placed: Any = t
            return DTensor.from_local(
                local,
                placed.device_mesh,
                placed.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        return torch.empty_like(t, device=target)

    forget_records(module)  # the registry's weak references would stop the swap
    if any(is_dtensor(t) and t.is_meta for t in (*module.parameters(), *module.buffers())):
        swap_module_tensors(module, allocate)  # DTensors: FSDP2 re-points its shards at the new storage
    names = _qualified_names(module) if on_value is not None else {}
    replaced: dict[int, torch.Tensor | None] = {id(t): None for t in _params_by_id(places) if id(t) in shards}
    with torch.no_grad():
        for sub, name, is_param, handle in places:
            tensors: Any = sub._parameters if is_param else sub._buffers
            old = tensors[name]
            if id(old) not in replaced:  # tied weights: one parameter in several places
                target = device if is_param else buffer_device
                if on_value is not None or not _place_whole_kept(old, handle, target, replaced):
                    full = _value(handle)
                    if on_value is not None:
                        on_value(names.get((id(sub), name), name), full)
                    replaced[id(old)] = _place(old, full, target)
            if replaced[id(old)] is not None:
                tensors[name] = replaced[id(old)]


def _params_by_id(places: list[Place]) -> list[Any]:
    return [(sub._parameters if is_param else sub._buffers)[name] for sub, name, is_param, _ in places]


def _place(old: torch.Tensor, full: torch.Tensor, device: Any) -> torch.Tensor | None:
    """A plain meta tensor: its replacement on ``device``. A DTensor: its local part filled in place (None)."""
    if is_dtensor(old):
        _copy_local(old, full.to(old.dtype))
        return None
    value = full.to(device=device, dtype=old.dtype)
    return type(old)(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value


def _kept_shards(places: list[Place]) -> dict[int, torch.Tensor]:
    """id of a meta DTensor -> the part of its value kept at construction, where that is its shard.

    A DTensor holds chunk ``index`` of ``parts`` along dim 0 only under one ``Shard(0)`` over a
    mesh of ``parts`` ranks where it is rank ``index``; anything else is replayed. A kept part is
    used once (the base forgets it), so two models never share storage.
    """
    out: dict[int, torch.Tensor] = {}
    for sub, name, is_param, handle in places:
        old: Any = (sub._parameters if is_param else sub._buffers)[name]
        kept = handle.base.kept
        if kept is None or handle.chain or not is_dtensor(old) or id(old) in out:
            continue
        from torch.distributed.tensor import Shard

        (parts, index), part = kept
        mesh = old.device_mesh
        if (
            mesh.ndim == 1
            and tuple(old.placements) == (Shard(0),)
            and (mesh.size(), mesh.get_local_rank()) == (parts, index)
            and tuple(old._local_tensor.shape) == tuple(part.shape)
        ):
            out[id(old)] = part
            handle.base.kept = None
    return out


def _place_whole_kept(old: Any, handle: Handle, device: Any, replaced: dict) -> bool:
    """A plain tensor whose whole value was kept at construction (part ``(1, 0)``): use it, no replay."""
    kept = handle.base.kept
    if kept is None or handle.chain or is_dtensor(old):
        return False
    (parts, index), part = kept
    if (parts, index) != (1, 0) or part.shape != old.shape:
        return False
    handle.base.kept = None
    value = part.to(device=device, dtype=old.dtype)
    replaced[id(old)] = (
        type(old)(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value
    )
    return True


def _copy_local(tensor: Any, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into the local tensor of ``tensor`` (a DTensor of any placement)."""
    from torch.distributed.tensor import distribute_tensor

    if not full.numel():  # no values to place (FSDP gives such a parameter a local part of its own shape)
        return
    local = tensor.to_local()
    part = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    if part.shape != local.shape:
        raise RuntimeError(
            f"A parameter of shape {tuple(full.shape)} placed as {tensor.placements} has a local part of"
            f" shape {tuple(local.shape)}, but its placements give {tuple(part.shape)}: materialize it"
            " before changing its local tensor."
        )
    local.copy_(part)


def _qualified_names(module: nn.Module) -> dict[tuple[int, str], str]:
    names: dict[tuple[int, str], str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name in (*sub._parameters, *sub._buffers):
            names.setdefault((id(sub), name), f"{prefix}.{name}" if prefix else name)
    return names
