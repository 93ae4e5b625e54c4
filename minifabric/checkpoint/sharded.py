"""The sharded format: a folder of torch Distributed Checkpoint (DCP) shards plus a side record.

Layout of a committed version folder (``commit.py`` says how versions are committed in ``path``)::

    __0_0.distcp, __1_0.distcp, ...   each rank's shard of every module and optimizer tensor (DCP)
    .metadata                         DCP's index of the shards
    minifabric.pt                     side record (rank 0): metadata, per-rank RNG and stateful
                                      states, plain values, and a reference in place of each tensor
    COMMIT.json                       commit record, written last (see ``commit.py``)

Everything is read without unrestricted pickle: the side record with ``weights_only=True``, and
the shards and DCP's ``.metadata`` by ``reader.SafeReader``, whose unpicklers admit only DCP's own
metadata classes and the tensor-rebuild call.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter

from minifabric.checkpoint import commit
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.reader import SafeReader
from minifabric.checkpoint.state import FORMAT_KEY
from minifabric.checkpoint.tensors import split


@contextmanager
def _without_crc32() -> Iterator[None]:
    """Skip the CRC32 that ``torch.save`` computes over every byte of a shard (about a third of the write time).

    Completeness is checked by the commit record's file sizes, and ``torch.load`` reads records
    without the checksum. The switch is process-wide for the duration of the write.
    """
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def prepare(path: Path) -> commit.Staging:
    """Check ``path`` and create a staging folder for it (rank 0; the caller shares the outcome)."""
    error = commit.target_error(path)
    if error:
        raise CheckpointError(error)
    try:
        return commit.make_staging(path)
    except OSError as err:
        raise CheckpointError(f"Cannot create a staging folder for {str(path)!r}: {err}") from err


def split_entries(
    collected: dict[str, Any], kinds: dict[str, str]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Module and optimizer tensors, and DTensors anywhere, go to DCP (by reference); the rest stays in the record.

    A DTensor among plain values (e.g. ``acc.save(path, model.state_dict())`` under FSDP) is thus
    saved whole, each rank writing its shard, instead of rank 0's shard alone.
    """
    tree: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, value in collected.items():
        everything = kinds[key] in ("module", "optimizer")
        tree[key], found = split(key, value, only_dtensors=not everything)
        tensors.update(found)
    return tree, tensors


def write_shards(comm: Comm, work: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every rank writes its shard of ``tensors`` into the staging folder ``work`` (collective, DCP)."""
    commit.fault("before_shard", comm.rank)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        writer = FileSystemWriter(work)
        with _without_crc32():
            dcp.save(tensors, storage_writer=writer, process_group=comm.group, no_dist=not comm.distributed)
    commit.fault("after_shard", comm.rank)


def commit_side(staging: commit.Staging, side: dict[str, Any], world_size: int) -> None:
    """Write the side record into the staging folder, then commit it (rank 0, after every shard)."""
    with open(staging.work / commit.SIDE_RECORD, "wb") as f:
        torch.save(side, f)
        f.flush()
        os.fsync(f.fileno())
    commit.commit(staging, world_size)


def read_side_record(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify the committed version folder ``path`` and return its side record's ``(meta, tree)``."""
    commit.verify(path)
    try:
        data = torch.load(path / commit.SIDE_RECORD, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"The side record of {str(path)!r} cannot be loaded safely ({err}).") from err
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        raise CheckpointError(f"{str(path / commit.SIDE_RECORD)!r} is not a minifabric side record.")
    return data[FORMAT_KEY], data["state"]


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"{key!r} needs unpickling of arbitrary classes, which loading never does ({type(err).__name__})."
            ) from err


def read_tensors(path: Path, targets: dict[str, Any], views: Collection[str] = ()) -> None:
    """Fill ``targets`` (``{key: fresh tensor}``, DTensors get their shard) from the DCP files at ``path``.

    A key in ``views`` may instead get a view of the mapped shard file in place of its target
    (copy-on-write, never written back; the caller copies it into the model and drops it). A non-tensor value stored by
    DCP (Fabric's folders have some) replaces its placeholder in ``targets``.

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
            dcp.load(targets, storage_reader=SafeReader(path, views), planner=planner, no_dist=True)
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        if isinstance(err, KeyboardInterrupt):
            raise
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]
        cause = failures[0] if len(failures) == 1 and isinstance(failures[0], BaseException) else err
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        text = str(cause) if isinstance(cause, CheckpointError) else f"{type(cause).__name__}: {cause}"
        raise CheckpointError(f"Reading the tensors of {str(path)!r} failed: rank {rank}: {text}") from err
    targets.update(planner.state_dict)  # DCP reads into its own copy of the dict


__all__ = [
    "SafeReader",
    "commit_side",
    "prepare",
    "read_side_record",
    "read_tensors",
    "split_entries",
    "write_shards",
]
