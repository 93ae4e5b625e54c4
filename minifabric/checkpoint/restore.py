"""Loading a checkpoint of either format into a user's ``state``: validate everything, then restore in place.

The order matters: keys, shapes and optimizer layouts are checked against the checkpoint's side
record before any tensor is read, and tensors are read into fresh buffers (sharded like the live
ones) before anything is copied into the model, so a failed load leaves the model and optimizer
as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint import commit, fabric, full, rng, sharded
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.names import group_problems, is_named, parameter_names, to_indices
from minifabric.checkpoint.state import (
    is_stateful,
    kind_problems,
    load_module,
    load_optimizer,
    optimizer_problems,
    validate,
)
from minifabric.checkpoint.tensors import TENSOR_REF, empty_target, equal, is_ref, map_tree, place


@dataclass
class Opened:
    """A checkpoint whose side record has been read and checked; tensors are read on demand."""

    path: Path
    meta: dict[str, Any]
    tree: dict[str, Any]
    sharded: bool

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Each saved rank's record: ``{"rng": ..., "stateful": {name: state}}``."""
        return self.meta.get("ranks") or []

    def names(self) -> set[str]:
        """Every entry the checkpoint holds."""
        stateful = self.ranks[0]["stateful"] if self.ranks else {}
        return set(self.tree) | set(stateful)


def open_checkpoint(path: Path) -> Opened:
    """Read the metadata of the checkpoint at ``path`` (a sharded folder or one file; minifabric's or Fabric's)."""
    if fabric.is_fabric_folder(path):
        meta, tree = fabric.folder_layout(
            path, sharded.SafeReader(path), lambda t: sharded.read_tensors(path, t)
        )
        return Opened(path, meta, tree, sharded=True)
    found = commit.locate(path)
    if found.is_dir():
        meta, tree = sharded.read_side_record(found)
        return Opened(found, meta, tree, sharded=True)
    meta, tree = full.read_checkpoint(found)
    return Opened(found, meta, tree, sharded=False)


Resolver = Callable[[tuple], Any]


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


def materialize(
    opened: Opened, wanted: dict[str, Resolver], views: Mapping[str, Collection[str]] | None = None
) -> dict[str, Any]:
    """The saved trees of ``wanted`` entries with real tensors, each laid out like its live counterpart.

    ``views`` maps an entry to the keys of its state dict that may come back as views of the mapped
    shard files: name only tensors that are copied out (into a module's parameters and buffers)
    and then dropped.
    """
    views = views or {}
    targets: dict[str, Any] = {}
    viewable: set[str] = set()

    def entry(name: str, resolve: Resolver) -> Any:
        def leaf(path: tuple, value: Any) -> Any:
            if is_ref(value):
                targets[value[TENSOR_REF]] = empty_target(value, resolve(path))
                if len(path) == 1 and path[0] in views.get(name, ()):
                    viewable.add(value[TENSOR_REF])
                return value
            if isinstance(value, torch.Tensor):
                return place(value, resolve(path))
            return value

        return map_tree(opened.tree[name], leaf)

    out = {name: entry(name, resolve) for name, resolve in wanted.items()}
    if opened.sharded:
        sharded.read_tensors(opened.path, targets, views=viewable)
    return map_tree(out, lambda path, value: targets[value[TENSOR_REF]] if is_ref(value) else value)


def check(opened: Opened, state: dict[str, Any], strict: bool) -> list[str]:
    """Validate ``state`` against the checkpoint; return what ``strict=False`` tolerated.

    The modules' key and shape problems come first in the message: an optimizer mismatch is
    usually their consequence. Named optimizer entries are mapped to the live optimizer's indices.

    Raises:
        CheckpointError: naming every problem; nothing has been changed.
    """
    modules = {k: v.state_dict() for k, v in state.items() if isinstance(v, nn.Module)}
    available = {name: opened.tree.get(name) for name in opened.names()}
    problems, tolerated = validate(state, modules, available, strict, raise_=False)
    problems += kind_problems(state, opened.meta.get("kinds", {}))
    live_modules = [v for v in state.values() if isinstance(v, nn.Module)]
    for key, value in state.items():
        if not isinstance(value, Optimizer) or key not in opened.tree:
            continue
        saved = opened.tree[key]
        if is_named(saved):
            names = parameter_names(value, live_modules)
            found = group_problems(key, saved, value, names)
            if not found and names is not None:
                opened.tree[key] = to_indices(saved, names)
            problems += found
        else:
            problems += optimizer_problems(key, value, saved)
    if problems:
        keys_only = strict and tolerated and not any(p.startswith("shape") for p in problems)
        fix = " Pass `strict=False` to load the matching keys only." if keys_only else ""
        raise CheckpointError(
            f"The checkpoint {str(opened.path)!r} does not match `state`: " + " | ".join(problems) + "." + fix
        )
    return tolerated


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


def _leftover(opened: Opened, name: str, materialized: dict[str, Any], rank: int, world_size: int) -> Any:
    if name in materialized:
        return materialized[name]
    if name in opened.tree:
        return opened.tree[name]
    records = opened.ranks
    return records[rank if len(records) == world_size else 0]["stateful"][name]


def load(path: Path, state: dict[str, Any], strict: bool, comm: Comm) -> dict[str, Any]:
    """Restore ``state`` in place from the checkpoint at ``path``; return the entries it did not ask for.

    Collective. Opening and checking, then reading the tensors, each end with an agreement of all
    ranks; only after both succeeded everywhere is anything applied.

    Raises:
        CheckpointError: on every rank, if on any rank the path is no committed checkpoint, does not
            match ``state`` or cannot be read (nothing has been changed then).
    """
    context = f"Loading the checkpoint {str(path)!r} failed"
    outcome = "; nothing was changed."
    error: BaseException | None = None
    try:
        opened = open_checkpoint(path)
        tolerated = check(opened, state, strict)
    except Exception as err:
        error = err
    comm.agree(error, context, outcome)
    error = None
    try:
        materialized = _read(opened, state, comm)
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        error = err
    comm.agree(error, context, outcome)
    return _apply(opened, state, materialized, tolerated, strict, comm.rank, comm.world_size)


def _read(opened: Opened, state: dict[str, Any], comm: Comm) -> dict[str, Any]:
    """Every module and optimizer entry (and DTensor values) read into fresh tensors laid out like the live ones.

    Entries that ``state`` does not ask for are read sharded over the ranks (DTensors split on their
    first dimension), so no rank holds them at full size.
    """
    wanted: dict[str, Resolver] = {}
    for key, value in state.items():
        if isinstance(value, (nn.Module, Optimizer)) and key in opened.tree:
            wanted[key] = _resolver(value)
            if isinstance(value, nn.Module):  # unexpected keys are tolerated only under strict=False
                live = value.state_dict()
                opened.tree[key] = {k: v for k, v in opened.tree[key].items() if k in live}
    kinds = opened.meta.get("kinds", {})
    spread = comm.mesh() if opened.sharded and comm.distributed else None
    for key in opened.tree:
        if key not in wanted and (kinds.get(key) in ("module", "optimizer") or _has_refs(opened.tree[key])):
            wanted[key] = _resolver(state.get(key)) if key in state or spread is None else lambda path: spread
    views = {key: _copied_names(value) for key, value in state.items() if isinstance(value, nn.Module)}
    return materialize(opened, wanted, views=views)


def _copied_names(module: nn.Module) -> set[str]:
    """The state-dict keys that ``load_state_dict`` copies into ``module``: its parameters and buffers.

    Not its extra state, which ``set_extra_state`` may keep as given.
    """
    params = module.named_parameters(remove_duplicate=False)
    buffers = module.named_buffers(remove_duplicate=False)
    return {name for name, _ in params} | {name for name, _ in buffers}


def _has_refs(tree: Any) -> bool:
    found: list[bool] = []
    map_tree(tree, lambda path, leaf: found.append(is_ref(leaf)))
    return any(found)


def _apply(
    opened: Opened,
    state: dict[str, Any],
    materialized: dict[str, Any],
    tolerated: list[str],
    strict: bool,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    path = opened.path
    for key, value in state.items():
        if key not in opened.tree:
            continue
        if isinstance(value, nn.Module):
            load_module(value, materialized[key], strict=strict)
        elif isinstance(value, Optimizer):
            load_optimizer(value, materialized[key])
        elif not is_stateful(value):
            state[key] = materialized.get(key, opened.tree[key])
    if opened.ranks:
        _restore_per_rank(opened, state, rank, world_size)
    if tolerated:
        warnings.warn(
            f"Loaded {str(path)!r} with strict=False; not restored: {', '.join(tolerated)}.", stacklevel=3
        )
    names = opened.names()
    return {k: _leftover(opened, k, materialized, rank, world_size) for k in names if k not in state}
