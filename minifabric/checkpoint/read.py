"""Opening a checkpoint and reading its tensors, above the storage layer (``reader.py``, ``archive.py``).

:func:`open_checkpoint` reads only the metadata and the tree of a checkpoint (minifabric's sharded
folder or one file, or Lightning Fabric's), checks its format version, and returns an
:class:`Opened` whose tensors are references until :func:`read_entries` reads them. Everything is
read without unrestricted pickle: records with ``format.safe_load``, the shards and DCP's
``.metadata`` by ``reader.SafeReader``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from minifabric._torch import laid_out_like
from minifabric.checkpoint import commit, fabric
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import FORMAT_KEY, SIDE_RECORD, TENSOR_REF, check_version, is_ref, safe_load
from minifabric.checkpoint.reader import SafeReader
from minifabric.checkpoint.tensors import empty_target, map_tree


@dataclass(frozen=True)
class Opened:
    """A checkpoint whose metadata has been read and checked; tensors are read on demand."""

    path: Path
    meta: dict[str, Any]
    tree: dict[str, Any]
    sharded: bool

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Each saved rank's record: ``{"rng": ..., "stateful": {name: state}}``."""
        return self.meta.get("ranks") or []

    @property
    def kinds(self) -> dict[str, str]:
        """What each saved entry is (``format.KINDS``)."""
        return self.meta.get("kinds", {})

    def names(self) -> set[str]:
        """Every entry the checkpoint holds."""
        stateful = self.ranks[0]["stateful"] if self.ranks else {}
        return set(self.tree) | set(stateful)


def open_checkpoint(path: Path, *, weights_only: bool = True) -> Opened:
    """Read the metadata of the checkpoint at ``path`` (a sharded folder or one file; minifabric's or Fabric's).

    Raises:
        CheckpointError: no committed checkpoint at ``path``, one that cannot be read safely, or one
            written by a newer format version.
    """
    if fabric.is_fabric_folder(path):
        meta, tree = fabric.folder_layout(path, SafeReader(path), lambda t: read_tensors(path, t))
        return Opened(path, meta, tree, sharded=True)
    found = commit.locate(path)
    if found.is_dir():
        commit.verify(found)
        data = safe_load(found / SIDE_RECORD, str(found / SIDE_RECORD))
        where = found / SIDE_RECORD
    else:
        data = read_file(found, weights_only=weights_only)
        where = found
        if isinstance(data, dict) and FORMAT_KEY not in data and fabric.is_fabric_file(data):
            meta, tree = fabric.file_layout(data)
            return Opened(found, meta, tree, sharded=False)
    if fabric.is_optimizer_state_dict(data):
        raise CheckpointError(
            f"{str(where)!r} holds one optimizer's state dict (`torch.save(optimizer.state_dict())`), not a"
            " checkpoint: `load` would find none of the entries of `state` in it. Load it with"
            " `acc.load_raw(path, optimizer)`."
        )
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        raise CheckpointError(
            f"{str(where)!r} is not a minifabric checkpoint. For a plain `torch.save(model.state_dict())`"
            " file use `acc.load_raw(path, model)`."
        )
    check_version(data[FORMAT_KEY], where)
    return Opened(found, data[FORMAT_KEY], data["state"], sharded=found.is_dir())


def read_file(path: Path, *, weights_only: bool = True) -> Any:
    """Read a one-file checkpoint (or a plain state-dict file) with ``weights_only=True``, mapped."""
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.")
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint folder, not one file. Load it with"
            f" `acc.load(path, {{'model': model}})`, or merge it first: `minifabric consolidate {path} model.pt`."
        )
    return safe_load(path, str(path), mmap=True, weights_only=weights_only)


Resolver = Callable[[tuple], Any]


def read_entries(
    opened: Opened,
    wanted: dict[str, tuple[Any, Resolver]],
    views: Mapping[str, Collection[tuple]] | None = None,
) -> dict[str, Any]:
    """The saved trees of the ``wanted`` entries with real tensors, each laid out like its live counterpart.

    ``wanted`` maps an entry to its saved tree (references in place of tensors) and a resolver: the path of a leaf in the saved tree -> the live tensor
    it will land in (its layout: a DTensor gets its shard), a ``DeviceMesh`` to read it sharded, or
    None. ``views`` maps an entry to the paths in its saved tree that may come back as views of the
    mapped shard files: name only tensors that are copied out (into a module's parameters and
    buffers) and then dropped; in a one-file checkpoint (mapped whole) every other tensor is
    copied into fresh memory. Tensors are read into fresh memory; nothing live is written.
    """
    views = views or {}
    targets: dict[str, Any] = {}
    viewable: set[str] = set()

    def entry(name: str, tree: Any, resolve: Resolver) -> Any:
        def leaf(path: tuple, value: Any) -> Any:
            if is_ref(value):
                targets[value[TENSOR_REF]] = empty_target(value, resolve(path))
                if path in views.get(name, ()):
                    viewable.add(value[TENSOR_REF])
                return value
            if isinstance(value, torch.Tensor):  # a one-file checkpoint: a view of the mapped file
                if path not in views.get(name, ()):  # may be kept as given: into fresh memory
                    value = value.clone()
                return laid_out_like(value, resolve(path))
            return value

        return map_tree(tree, leaf)

    out = {name: entry(name, tree, resolve) for name, (tree, resolve) in wanted.items()}
    if targets and not opened.sharded:
        raise CheckpointError(
            f"{str(opened.path)!r} holds references to tensors of a sharded checkpoint ({sorted(targets)[:3]}),"
            " not the tensors: it is no complete checkpoint. Consolidate the sharded checkpoint again with"
            " `minifabric consolidate CKPT_DIR OUT_FILE`."
        )
    if opened.sharded:
        read_tensors(opened.path, targets, views=viewable)
    return map_tree(out, lambda path, value: targets[value[TENSOR_REF]] if is_ref(value) else value)


def has_refs(tree: Any) -> bool:
    """Whether ``tree`` holds a tensor reference anywhere."""
    found: list[bool] = []
    map_tree(tree, lambda path, leaf: found.append(is_ref(leaf)))
    return any(found)


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        key = read_item.dest_index.fqn
        self.state_dict[key] = safe_load(value, key)


def read_tensors(path: Path, targets: dict[str, Any], views: Collection[str] = ()) -> None:
    """Fill ``targets`` (``{key: fresh tensor}``, DTensors get their shard) from the DCP files at ``path``.

    A key in ``views`` may instead get a view of the mapped shard file in place of its target
    (copy-on-write, never written back; the caller copies it into the model and drops it). A
    non-tensor value stored by DCP (Fabric's folders have some) replaces its placeholder in ``targets``.

    Each rank plans and reads its own part without collectives; the caller agrees on the outcome.
    """
    if not targets:
        return
    planner = _SafePlanner(flatten_state_dict=False)
    try:
        with warnings.catch_warnings():  # no_dist is deliberate: each rank reads its own part
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single process.*"
            )
            reader = SafeReader(path, views)
            reader.read_metadata()  # its refusal raised here: some torch versions swallow it inside load
            dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        if isinstance(err, KeyboardInterrupt):
            raise
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]
        cause = failures[0] if len(failures) == 1 and isinstance(failures[0], BaseException) else err
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        text = str(cause) if isinstance(cause, CheckpointError) else f"{type(cause).__name__}: {cause}"
        raise CheckpointError(f"Reading the tensors of {str(path)!r} failed: rank {rank}: {text}") from err
    targets.update(planner.state_dict)  # DCP reads into its own copy of the dict
