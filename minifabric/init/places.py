"""Stage 1 of ``setup``'s materialization: find every meta tensor's recorded init, and check it.

:func:`recorded_places` reads the record attached to the model (:mod:`~minifabric.init.attach`)
and returns it as a value, a list of :data:`Place`: where each meta tensor is and the handle of its
recipe. Everything that would make the eager values impossible to reproduce is refused here, before
anything is changed (and so before any collective): a meta tensor with no record, one written
after its block ended, a recipe marked unreproducible, uninitialized memory.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from minifabric._torch import tensor_version
from minifabric.init.attach import handle_of, module_record, sealed_version, written_unseen
from minifabric.init.recipe import Handle, Real, Ref
from minifabric.init.replay import apply_chain

#: (module, attribute name, is a parameter, recorded init) for every meta tensor of a model.
Place = tuple[nn.Module, str, bool, Handle]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` still lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


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
                sealed = sealed_version(t)
                if sealed is not None and tensor_version(t) != sealed:
                    raise ValueError(_changed_after(prefix, name, where))
                if rebuilt_by is None and handle_of(t) is None and written_unseen(t):
                    # known by name only (a `copy.deepcopy` made after the block), then written
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
