"""Tensor plumbing shared by the checkpoint stages: walking trees, placing shards, gathering.

Tensor references (what a sharded checkpoint's side record holds in place of each tensor) are
defined in ``format.py``; the copies of an asynchronous save are made by ``staging.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import empty as dtensor_empty

from minifabric.checkpoint.format import is_ref, make_ref, ref_dtype


def map_tree(tree: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """Apply ``fn(path, leaf)`` to every leaf of nested dicts/lists/tuples; references are leaves."""
    if isinstance(tree, dict) and not is_ref(tree):
        return {k: map_tree(v, fn, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, fn, (*path, i)) for i, v in enumerate(tree))
    return fn(path, tree)


def split(
    prefix: str, tree: Any, only_dtensors: bool = False, into: dict[str, torch.Tensor] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor (or only every DTensor) in ``tree`` by a reference; return the new tree and ``{key: tensor}``.

    ``into`` (the tensors of the entries split before) is filled and returned instead of a new dict.

    Raises:
        ValueError: two tensors whose paths join to one key (``{"a/b": x, "a": {"b": y}}``, the
            keys ``0`` and ``"0"``): one would be saved in place of the other.
    """
    tensors: dict[str, torch.Tensor] = {} if into is None else into

    def take(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, DTensor if only_dtensors else torch.Tensor):
            return leaf
        key = "/".join(map(str, (prefix, *path)))
        if key in tensors:
            raise ValueError(
                f"Two tensors of state would be saved under the one key {key!r} (the path"
                f" {[prefix, *path]!r} and another whose parts join alike), and one would be read back"
                " in place of the other. Nothing was written. Fix: rename a key so that no key"
                " contains '/' and no dict holds both 0 and '0'."
            )
        tensors[key] = leaf
        return make_ref(key, leaf)

    return map_tree(tree, take), tensors


def empty_target(ref: dict[str, Any], like: Any) -> torch.Tensor:
    """A fresh tensor to load ``ref`` into: sharded like ``like`` when it is a DTensor of that shape.

    With a ``DeviceMesh`` as ``like``, a DTensor split over it on the first dimension (replicated
    when that dimension is shorter than the mesh).
    """
    dtype = ref_dtype(ref)
    if isinstance(like, DeviceMesh):
        shape = list(ref["shape"])
        placements = [Shard(0)] if shape and shape[0] >= like.size() else [Replicate()]
        return dtensor_empty(shape, dtype=dtype, device_mesh=like, placements=placements)
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(ref["shape"]):
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(ref["shape"], dtype=dtype)


def shard_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out like ``like`` (no communication)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def gather_full(tree: Any, keep: bool) -> Any:
    """Replace every DTensor by its full tensor on CPU (collective); drop the copies where not ``keep``.

    DTensors are gathered one at a time, so only one full tensor is alive at once per rank.
    """

    def full(path: tuple, leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            value = leaf.full_tensor()
            return value.cpu() if keep else None
        return leaf

    return map_tree(tree, full)


def equal(a: Any, b: Any) -> bool:
    """Deep equality of nested containers that may hold tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
