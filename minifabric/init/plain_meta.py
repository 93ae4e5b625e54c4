"""A model built under plain ``torch.device("meta")``, outside ``init_module``: materialized as Lightning Fabric does.

Such a model has no recorded init, so :mod:`~minifabric.init.materialize` cannot give it eager
construction's values; :func:`reset_meta_modules` gives its meta tensors memory and runs each
module's ``reset_parameters()``, keeping the real tensors the model already held.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from minifabric._torch import refusing_writes, storage_key, swap_module_tensors
from minifabric.init.attach import has_init_records
from minifabric.init.places import has_meta_tensors


def reset_meta_modules(module: nn.Module, device: torch.device | str) -> bool:
    """Materialize a model built under plain ``torch.device("meta")`` as Lightning Fabric does.

    Such a model has no recorded init (it was not built in ``init_module(empty_init=True)``, the
    exact path): its meta tensors get memory on ``device``, then each module holding one runs its
    ``reset_parameters()``; modules without one keep uninitialized memory, named in Fabric's
    warning. Parameter objects are kept (tied weights stay tied), and so are the real tensors the
    model held before (a pretrained part loaded with ``load_state_dict(..., assign=True)``): a
    ``reset_parameters()`` that would write into one, or replace it, raises naming both, before the
    write. Returns whether it did anything (nothing for a model without meta tensors or built
    inside ``init_module``).
    """
    if not has_meta_tensors(module) or has_init_records(module):
        return False
    tensors = dict((*module.named_parameters(), *module.named_buffers()))
    kept = {name: t for name, t in tensors.items() if not t.is_meta}
    memory = {name: t.detach() for name, t in kept.items()}  # an alias: keeps the memory alive
    holding_meta = [
        (name, sub)
        for name, sub in module.named_modules()
        if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)))
    ]
    swap_module_tensors(module, lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    made = {id(t) for name, t in (*module.named_parameters(), *module.named_buffers()) if name not in kept}
    protected = {storage_key(t): name for name, t in kept.items() if t.numel()}
    uninitialized = []
    try:
        for name, sub in holding_meta:
            reset = getattr(sub, "reset_parameters", None)
            if not callable(reset):
                uninitialized.append(type(sub).__name__)
                continue

            def refuse(tensor: str, op: str, name: str = name, sub: nn.Module = sub) -> ValueError:
                who = f"`{name or 'the model'}.reset_parameters()` ({type(sub).__name__})"
                return _overwrites_real(who, tensor, op)

            with refusing_writes(protected, refuse):
                reset()
        now = dict((*module.named_parameters(), *module.named_buffers()))
        for name, tensor in kept.items():
            if (
                now.get(name) is not tensor
                or tensor.untyped_storage().data_ptr() != memory[name].untyped_storage().data_ptr()
            ):
                raise _overwrites_real("a `reset_parameters()`", name, "new memory in its place")
    except BaseException:  # as before `setup`: the real tensors as they were, the others on meta again
        _restore(module, kept, memory)
        swap_module_tensors(module, lambda t: torch.empty_like(t, device="meta") if id(t) in made else t)
        raise
    if uninitialized:
        warnings.warn(
            "Parameter initialization incomplete. The following modules have parameters or buffers with"
            " uninitialized memory because they don't define a `reset_parameters()` method for"
            f" re-initialization: {', '.join(dict.fromkeys(uninitialized))}",
            stacklevel=3,
        )
    return True


def _restore(module: nn.Module, kept: dict[str, torch.Tensor], memory: dict[str, torch.Tensor]) -> None:
    """Put each kept tensor back at its name, over the memory it had."""
    for name, tensor in kept.items():
        owner, _, attr = name.rpartition(".")
        sub = module.get_submodule(owner)
        table = sub._parameters if attr in sub._parameters else sub._buffers
        table[attr] = tensor
        if tensor.untyped_storage().data_ptr() != memory[name].untyped_storage().data_ptr():
            tensor.data = memory[name]


def _overwrites_real(who: str, tensor: str, how: str) -> ValueError:
    return ValueError(
        f"{who} would overwrite {tensor!r} ({how}), a real tensor the model held before `setup` (a part"
        " loaded with `assign=True`?) in a model built under plain `torch.device('meta')`; `setup` keeps"
        " real tensors. Build the model inside `acc.init_module(empty_init=True)` (its init is then"
        " replayed on the meta tensors only), or materialize it yourself before `setup`."
    )
