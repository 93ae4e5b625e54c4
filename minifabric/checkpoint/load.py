"""Loading a checkpoint into a user's ``state``: open -> validate -> read -> apply.

The order is the guarantee: keys, shapes and optimizer layouts are checked against the
checkpoint's metadata before any tensor is read, and tensors are read into fresh memory (sharded
like the live tensors) before anything is copied into the model, so a failed load changes nothing.
Opening and reading each end with an agreement of all ranks; only after both succeeded everywhere
is anything applied.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from minifabric._torch import laid_out_like, load_pre_hooks_keep_nothing
from minifabric.checkpoint import layout, rng, validate
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.format import is_ref, is_stateful, ref_dtype
from minifabric.checkpoint.read import Opened, Resolver, has_refs, open_checkpoint, read_entries
from minifabric.checkpoint.tensors import equal


def load(
    path: Path, state: dict[str, Any], strict: bool, comm: Comm, *, weights_only: bool = True
) -> dict[str, Any]:
    """Restore ``state`` in place from the checkpoint at ``path``; return the entries it did not ask for.

    Collective (every rank calls it).

    Raises:
        CheckpointError: on every rank, if on any rank the path is no committed checkpoint, does not
            match ``state`` or cannot be read (nothing has been changed then).
    """
    failed = (f"Loading the checkpoint {str(path)!r} failed", "; nothing was changed.")
    with comm.agreed(*failed):
        opened = open_checkpoint(path, weights_only=weights_only)
        plan = validate.plan(opened, state, strict)
    with comm.agreed(*failed):
        read = read_entries(opened, _wanted(opened, plan, state, comm), views=_views(state, plan))
    apply(opened, state, read, strict, comm.rank, comm.world_size)
    if plan.tolerated:
        warnings.warn(
            f"Loaded {str(path)!r} with strict=False; not restored: {', '.join(plan.tolerated)}.",
            stacklevel=3,
        )
    return {
        k: leftover(opened, k, read, comm.rank, comm.world_size) for k in opened.names() if k not in state
    }


def _wanted(opened: Opened, plan: validate.LoadPlan, state: dict[str, Any], comm: Comm) -> dict[str, Any]:
    """Every entry with tensors, each with the tree to read and where its tensors land.

    Entries that ``state`` asks for land like their live tensors; the others are read sharded over
    the ranks (DTensors split on their first dimension), so no rank holds them at full size.
    """
    spread = comm.mesh() if opened.sharded and comm.distributed else None
    wanted: dict[str, Any] = {key: (tree, _resolver(state[key])) for key, tree in plan.trees.items()}
    for key, tree in opened.tree.items():
        if key in wanted or not (opened.kinds.get(key) in ("module", "optimizer") or has_refs(tree)):
            continue
        wanted[key] = (
            tree,
            _resolver(state.get(key)) if key in state or spread is None else lambda p: spread,
        )
    return wanted


def _resolver(obj: Any) -> Resolver:
    """Maps a path in the saved tree to the live tensor it will land in (for its layout), or None."""
    if isinstance(obj, nn.Module):
        live = obj.state_dict()
        return lambda path: live.get(path[0]) if len(path) == 1 else None
    if isinstance(obj, Optimizer):
        params = [p for group in obj.param_groups for p in group["params"]]

        def param_for(path: tuple) -> Any:
            index = path[1] if len(path) == 3 and path[0] == "state" else None
            return params[index] if isinstance(index, int) and 0 <= index < len(params) else None

        return param_for
    return lambda path: None


def _views(state: dict[str, Any], plan: validate.LoadPlan) -> dict[str, set[tuple]]:
    """Per entry, the paths of the saved tensors that are surely copied out (and may be read as file views).

    A parameter or buffer qualifies when the module owning it, and every module above it, loads
    with ``nn.Module``'s own ``_load_from_state_dict`` (identified by its code, on the instance or
    its class), which copies into the live tensor, and has no load pre-hook but FSDP2's own. A module
    that overrides it, or a pre-hook (``register_load_state_dict_pre_hook``), sees the tensors of its whole subtree
    and may keep them (a cache, a buffer of varying length), which would keep the shard file mapped
    after the load: those are read into fresh memory. So are all tensors of a model whose
    ``load_state_dict`` is overridden. Extra
    state, which ``set_extra_state`` may keep as given, never qualifies. An optimizer's state tensor
    qualifies where the live optimizer already holds one of the same shape and dtype:
    :func:`load_optimizer` copies into it.
    """
    copies = nn.Module._load_from_state_dict.__code__
    loads = nn.Module.load_state_dict.__code__
    out: dict[str, set[tuple]] = {}
    for key, module in state.items():
        if isinstance(module, Optimizer) and key in plan.trees:
            out[key] = _optimizer_views(module, plan.trees[key])
        if not isinstance(module, nn.Module):
            continue
        out[key] = set()
        if _code(module, "load_state_dict") is not loads:
            continue
        every = list(module.named_modules(remove_duplicate=False))  # a shared module loads once per name
        # these see (and may keep) every tensor below them
        keeping = [
            prefix
            for prefix, sub in every
            if not load_pre_hooks_keep_nothing(sub) or _code(sub, "_load_from_state_dict") is not copies
        ]
        names: set[str] = set()
        for prefix, sub in every:
            if any(_under(prefix, above) for above in keeping):
                continue
            owned = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
            names |= {f"{prefix}.{name}" if prefix else name for name, _ in owned}
        out[key] = {(name,) for name in names}
    return out


def _same_layout(state: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``state`` is laid out like ``param``: both plain, or DTensors of one mesh and placements.

    A saved value is placed like its parameter, and :func:`_into` copies it only into a live tensor
    of the same layout.
    """
    if isinstance(state, DTensor) != isinstance(param, DTensor):
        return False
    if isinstance(state, DTensor) and isinstance(param, DTensor):
        return state.placements == param.placements and state.device_mesh == param.device_mesh
    return True


def _code(module: nn.Module, method: str) -> Any:
    """The code object ``module.method`` runs (set on the instance or its class), or None."""
    function = vars(module)[method] if method in vars(module) else getattr(type(module), method, None)
    return getattr(getattr(function, "__func__", function), "__code__", None)


def _under(prefix: str, above: str) -> bool:
    """Whether the module at ``prefix`` is the module at ``above`` or inside it ("" is the root)."""
    return not above or prefix == above or prefix.startswith(above + ".")


def _optimizer_views(optimizer: Optimizer, saved: Any) -> set[tuple]:
    """The paths ``("state", index, name)`` of saved optimizer state that a live state tensor will receive."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = set()
    for index, values in (saved.get("state", {}) if isinstance(saved, dict) else {}).items():
        if not (isinstance(index, int) and 0 <= index < len(params)) or not isinstance(values, dict):
            continue
        live = optimizer.state.get(params[index], {})
        for name, ref in values.items():
            target = live.get(name)
            if not isinstance(target, torch.Tensor) or isinstance(target, nn.Parameter):
                continue
            if is_ref(ref) or isinstance(ref, torch.Tensor):  # a one-file checkpoint holds the tensor
                shape, dtype = (ref["shape"], ref_dtype(ref)) if is_ref(ref) else (ref.shape, ref.dtype)
                same = tuple(shape) == tuple(target.shape) and dtype == target.dtype
                if same and _same_layout(target, params[index]):  # what `_into` copies into
                    out.add(("state", index, name))
    return out


def apply(
    opened: Opened, state: dict[str, Any], read: dict[str, Any], strict: bool, rank: int, world_size: int
) -> None:
    """Copy what was read into ``state``: modules and optimizers in place, values by entry, then per-rank state.

    Optimizer state is laid out like its parameters first: state that cannot be is refused before
    any module is changed.
    """
    laid_out = {
        key: layout.optimizer_state(value, read[key], key)
        for key, value in state.items()
        if key in opened.tree and isinstance(value, Optimizer)
    }
    for key, value in state.items():
        if key not in opened.tree:
            continue
        if isinstance(value, nn.Module):
            load_module(value, read[key], strict=strict)
        elif isinstance(value, Optimizer):
            load_optimizer(value, laid_out[key])
        elif not is_stateful(value):
            state[key] = read.get(key, opened.tree[key])
    if opened.ranks:
        _restore_per_rank(opened, state, rank, world_size)


def load_module(module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load a state dict into ``module``; full tensors are cut to this rank's shard where it is sharded."""
    live = module.state_dict()
    module.load_state_dict({k: laid_out_like(v, live.get(k)) for k, v in state_dict.items()}, strict=strict)


def load_optimizer(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an index-keyed optimizer state dict; full state tensors are cut to the shard of their parameter.

    A state tensor the live optimizer already holds in the same layout is copied into (no new
    memory, and a view of a mapped shard file is dropped after the copy).

    Raises:
        ValueError: state that cannot be laid out like its sharded parameter (nothing loaded).
    """
    state_dict = layout.optimizer_state(optimizer, state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in state_dict.get("state", {}).items():
        if not (isinstance(index, int) and index < len(params)):
            state[index] = values
            continue
        live = optimizer.state.get(params[index], {})
        state[index] = {name: _into(value, live.get(name)) for name, value in values.items()}
    optimizer.load_state_dict({**state_dict, "state": state})


def _into(value: Any, live: Any) -> Any:
    """``live`` with ``value`` copied into it when both are tensors of one layout; else ``value``."""
    if not isinstance(value, torch.Tensor) or not isinstance(live, torch.Tensor) or value is live:
        return value
    if not _same_layout(live, value):
        return value
    source = value.to_local() if isinstance(value, DTensor) else value
    target = live.to_local() if isinstance(live, DTensor) else live
    if source.shape != target.shape or source.dtype != target.dtype or source.device != target.device:
        return value
    with torch.no_grad():
        target.copy_(source)
    return live


def _restore_per_rank(opened: Opened, state: dict[str, Any], rank: int, world_size: int) -> None:
    """Each rank's RNG and stateful objects: its own record, or a loud warning where none maps."""
    records = opened.ranks
    same_world = len(records) == world_size
    with_rng = "rng" in records[0]  # not in checkpoints written by Lightning Fabric
    not_restored: list[str] = []
    for key, obj in state.items():
        if (
            not is_stateful(obj)
            or isinstance(obj, (nn.Module, Optimizer))
            or key not in records[0]["stateful"]
        ):
            continue
        values = [record["stateful"][key] for record in records]
        if same_world:
            obj.load_state_dict(values[rank])
        elif all(equal(values[0], v) for v in values[1:]):
            obj.load_state_dict(values[0])  # the same on every saved rank: maps to any world size
        else:
            not_restored.append(f"{key!r} (its state differs between the saved ranks)")
    if same_world and with_rng:
        not_restored += [f"the {name} RNG state" for name in rng.restore(records[rank]["rng"])]
    elif with_rng:
        not_restored.append("the RNG states (python, numpy, torch, cuda), which are per rank")
    if not_restored:
        warnings.warn(
            f"The checkpoint {str(opened.path)!r} was saved by {len(records)} process(es) and is loaded by"
            f" {world_size}. NOT restored on rank {rank}: {', '.join(not_restored)}. Training continues, but"
            " it will not repeat the random numbers of the original run.",
            UserWarning,
            stacklevel=4,
        )


def leftover(opened: Opened, name: str, read: dict[str, Any], rank: int, world_size: int) -> Any:
    """An entry ``state`` did not ask for, as read (tensors), stored (values) or this rank's (stateful)."""
    if name in read:
        return read[name]
    if name in opened.tree:
        return opened.tree[name]
    records = opened.ranks
    return records[rank if len(records) == world_size else 0]["stateful"][name]
