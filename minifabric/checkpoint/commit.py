"""The crash-safe commit of a checkpoint folder.

A save never writes into a committed checkpoint. Every rank writes into a fresh staging folder next
to ``path`` (``.NAME.partial-XXXX``); once all ranks are done, rank 0 writes the commit record
(``COMMIT.json``, listing every file and its size) *last*, fsyncs, and swaps the staging folder into
``path`` with one atomic ``renameat2(RENAME_EXCHANGE)``. The previous checkpoint is deleted only
after the new one is in place. A process killed at any moment therefore leaves ``path`` holding a
whole checkpoint, and ``load`` refuses any folder whose commit record is missing or does not match
its files.

For tests, ``MINIFABRIC_CHECKPOINT_FAULT=POINT:RANK`` kills rank RANK with SIGKILL at POINT (one of
:data:`FAULT_POINTS`).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from minifabric.checkpoint.errors import CheckpointError

RECORD = "COMMIT.json"
SIDE_RECORD = "minifabric.pt"
FORMAT_NAME = "minifabric-sharded"
FAULT_ENV = "MINIFABRIC_CHECKPOINT_FAULT"
FAULT_POINTS = ("before_shard", "after_shard", "before_commit", "after_commit_record", "after_swap")


def fault(point: str, rank: int) -> None:
    """Kill this process at ``point`` if ``MINIFABRIC_CHECKPOINT_FAULT`` asks for it (fault injection)."""
    wanted = os.environ.get(FAULT_ENV, "")
    if wanted and wanted in (point, f"{point}:{rank}"):
        os.kill(os.getpid(), signal.SIGKILL)


def staging_prefix(path: Path) -> str:
    """The name prefix of staging folders for ``path``: hidden siblings that ``load`` never picks up."""
    return f".{path.name}.partial-"


def target_error(path: Path) -> str | None:
    """Why a sharded checkpoint cannot be saved to ``path``, or None (checked on rank 0 before writing)."""
    if path.exists() and not path.is_dir():
        return (
            f"Cannot save a sharded checkpoint to {str(path)!r}: it is a file, and a sharded checkpoint is a"
            f" folder. Choose a folder path, e.g. {str(path.with_suffix(''))!r}, or save one file with"
            ' `FSDPStrategy(state_dict_type="full")`.'
        )
    if path.is_dir() and any(path.iterdir()) and not (path / RECORD).is_file():
        return (
            f"Refusing to replace {str(path)!r}: it is a folder that holds no minifabric checkpoint."
            " Save to a new path or remove that folder first."
        )
    return unwritable_parent_error(path)


def unwritable_parent_error(path: Path) -> str | None:
    """Why nothing can be created at ``path`` (its nearest existing ancestor is not writable), or None."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"Cannot save to {str(path)!r}: {str(parent)!r} is not a writable directory. Pick a writable location."
    return None


def make_staging(path: Path) -> Path:
    """Create and return a fresh staging folder next to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f"{staging_prefix(path)}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(staging: Path, world_size: int) -> dict[str, Any]:
    """Write the commit record into ``staging`` (rank 0, after every rank finished); return it."""
    files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file() and p.name != RECORD}
    record = {
        "format": FORMAT_NAME,
        "version": 1,
        "world_size": world_size,
        "created": time.time(),
        "files": files,
    }
    tmp = staging / f".{RECORD}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / RECORD)
    fsync_path(staging)
    return record


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(err, f"renameat2({str(a)!r}, {str(b)!r}) failed: {os.strerror(err)}")


def swap_into_place(staging: Path, path: Path, rank: int = 0) -> None:
    """Move the committed ``staging`` folder to ``path``; remove the previous checkpoint afterwards."""
    if not path.exists():
        os.rename(staging, path)
        fsync_path(path.parent)
        return
    if _exchange(staging, path):
        fsync_path(path.parent)
        fault("after_swap", rank)
        shutil.rmtree(staging, ignore_errors=True)  # now holds the previous checkpoint
        return
    # Without an atomic exchange there is a short window where `path` is missing; `load` then
    # points at the `.old-` sibling that still holds the previous checkpoint.
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    os.rename(staging, path)
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale(path: Path, keep: Path | None = None) -> None:
    """Delete staging folders of earlier interrupted saves to ``path`` (rank 0, after a commit)."""
    for sibling in path.parent.glob(f"{staging_prefix(path)}*"):
        if sibling != keep:
            shutil.rmtree(sibling, ignore_errors=True)


def _interrupted_hint(path: Path) -> str:
    partial = sorted(path.parent.glob(f"{staging_prefix(path)}*")) + sorted(
        path.parent.glob(f".{path.name}.old-*")
    )
    if not partial:
        return ""
    return f" An interrupted save was found at {str(partial[0])!r}; it is never loaded."


def verify(path: Path) -> dict[str, Any]:
    """Check that ``path`` is a committed, complete sharded checkpoint; return its commit record.

    Raises:
        CheckpointError: no such folder, no commit record (an interrupted save), or files missing
            or of the wrong size.
    """
    if not path.exists():
        raise CheckpointError(
            f"No checkpoint at {str(path)!r}: the path does not exist.{_interrupted_hint(path)}"
        )
    record_path = path / RECORD
    if not record_path.is_file():
        interrupted = path.name.startswith(".") and ".partial-" in path.name
        if interrupted or any(path.glob("*.distcp")) or (path / SIDE_RECORD).exists():
            raise CheckpointError(
                f"{str(path)!r} was never committed: an interrupted save was found (no {RECORD}). It is not"
                " loaded; load the last complete checkpoint instead."
            )
        raise CheckpointError(f"{str(path)!r} is not a minifabric checkpoint (no {RECORD} in that folder).")
    try:
        record = json.loads(record_path.read_text())
        files = dict(record["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"The commit record {str(record_path)!r} is unreadable ({err}).") from err
    problems = []
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, the commit record says {size}")
    if problems:
        raise CheckpointError(f"The checkpoint {str(path)!r} is incomplete: " + "; ".join(problems) + ".")
    return record
