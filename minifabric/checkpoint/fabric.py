"""Checkpoints written by Lightning Fabric, read so that a run started with Fabric resumes with ``acc.load``.

Fabric writes one of two layouts:

- one file (``fabric.save`` under a single device or DDP, or FSDP with full state dicts): a
  ``torch.save`` of ``{name: module state dict | optimizer state dict | value}``;
- a sharded folder (FSDP with sharded state dicts): torch Distributed Checkpoint (DCP) files of the
  modules and optimizers, plus ``meta.pt`` with everything else.

Both are turned into the ``(meta, tree)`` form of minifabric's own checkpoints (tensors of the
folder as references to their DCP keys), so validation, resharding and restoring are the same code.
Everything is read with ``weights_only=True``: a checkpoint whose values need arbitrary classes to
unpickle is refused with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import TENSOR_REF, is_ref, safe_load

META = "meta.pt"
_OBJECT = "__object__"  # placeholder of a non-tensor DCP value until it is read


def is_fabric_folder(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder written by Lightning Fabric."""
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


def is_fabric_file(data: Any) -> bool:
    """Whether a loaded one-file checkpoint is Fabric's: a dict of named entries (state dicts or plain values).

    A dict holding only tensors is a plain ``torch.save(model.state_dict())`` file instead (``load_raw``).
    """
    if not isinstance(data, dict) or not data or not all(isinstance(k, str) for k in data):
        return False
    if is_optimizer_state_dict(data):  # torch.save(optimizer.state_dict()): load_raw's
        return False
    return not all(isinstance(v, torch.Tensor) for v in data.values())


def is_optimizer_state_dict(value: Any) -> bool:
    """Whether ``value`` is an optimizer's state dict (``state`` and ``param_groups``, each group with ``params``)."""
    if not isinstance(value, dict) or not {"param_groups", "state"} <= set(value):
        return False
    groups = value["param_groups"]
    return isinstance(groups, list) and all(isinstance(g, dict) and "params" in g for g in groups)


def _kind(value: Any) -> str | None:
    if isinstance(value, dict) and "param_groups" in value and "state" in value:
        return "optimizer"
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(v, torch.Tensor) or is_ref(v) for v in value.values())
    ):
        return "module"
    return None


def _layout(tree: dict[str, Any], rest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """minifabric's ``(meta, tree)`` for Fabric's entries: module and optimizer kinds, the rest as values."""
    kinds = {key: kind for key, value in tree.items() if (kind := _kind(value))}
    values = {key: value for key, value in {**tree, **rest}.items() if key not in kinds}
    meta = {"format": "lightning-fabric", "kinds": kinds, "ranks": [{"stateful": values}]}
    return meta, {**tree, **rest}


def file_layout(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(meta, tree)`` of a one-file Fabric checkpoint (already read with ``weights_only=True``)."""
    return _layout(data, {})


def folder_layout(path: Path, reader: Any, read: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(meta, tree)`` of a sharded Fabric folder; tensors stay references until restored.

    ``reader`` is the safe DCP reader of ``path``; ``read(targets)`` fills ``{key: placeholder}``
    with the non-tensor values DCP stored (e.g. the optimizers' ``param_groups``).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    routes = metadata.planner_data or {}
    tree: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for key, info in metadata.state_dict_metadata.items():
        route = tuple(routes.get(key, key.split(".", 1)))
        if isinstance(info, TensorStorageMetadata):
            dtype = str(info.properties.dtype).removeprefix("torch.")
            leaf: Any = {TENSOR_REF: key, "shape": list(info.size), "dtype": dtype}
        else:
            leaf = {_OBJECT: key}
            objects[key] = None
        node = tree
        for step in route[:-1]:
            node = node.setdefault(step, {})
        node[route[-1]] = leaf
    if objects:
        read(objects)
    tree = _fill(tree, objects)
    rest = safe_load(path / META, str(path / META))
    if not isinstance(rest, dict):
        raise CheckpointError(f"{str(path / META)!r} is not a dict of values; this is no Fabric checkpoint.")
    return _layout(tree, rest)


def _fill(tree: Any, objects: dict[str, Any]) -> Any:
    """``tree`` with each placeholder of a non-tensor DCP value replaced by the value read (lists rebuilt)."""
    if isinstance(tree, dict) and _OBJECT in tree:
        return objects[tree[_OBJECT]]
    if isinstance(tree, dict) and tree and all(isinstance(k, int) for k in tree):  # DCP flattened a list
        return [_fill(tree[i], objects) for i in sorted(tree)]
    if isinstance(tree, dict):
        return {k: _fill(v, objects) for k, v in tree.items()}
    return tree
