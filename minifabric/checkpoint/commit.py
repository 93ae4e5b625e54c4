"""The crash-safe commit of a sharded checkpoint: immutable version folders and a pointer file.

A sharded checkpoint at ``path`` is a folder::

    path/
      LATEST                  names the committed version; replaced with os.replace (the commit point)
      v000002-1a2b3c4d/       a committed version, never written again: shards, side record, COMMIT.json
      .partial-5e6f7a8b/      a save in progress or interrupted: never loaded, removed by the next commit

A save writes into a fresh ``.partial-*`` folder inside ``path``. Once every rank is done, rank 0
writes the side record and the commit record (``COMMIT.json``: every file and its size) into it,
fsyncs, renames it to its version name, then writes ``.LATEST.tmp``, fsyncs it and renames it onto
``LATEST``. Every step is a single rename within one folder, which POSIX makes atomic on every file
system (NFS, Lustre and GPFS included), and at every instant ``LATEST`` names a whole version: a
process killed at any point leaves ``path`` loading as exactly the previous or exactly the new
checkpoint. docs/checkpoints.md lists the points.

Only after the commit are older versions and leftovers removed: they are renamed into one folder
beside ``path`` (``.NAME.removing-*``), so that ``path`` holds exactly ``LATEST`` and the new
version when the save returns (it can be copied or archived at once), and that folder is deleted on
a background thread (freeing a large file's blocks takes a quarter of a write's time), which the
next save waits for before it creates its staging folder. A process killed before the deletion
ended leaves that folder for the next commit to remove; nothing reads it.

Where ``path`` is a one-file checkpoint, the new folder is built whole next to it, the file is
renamed aside, the folder renamed to ``path`` and the file removed; ``load`` finds the file aside if
a crash came between the two renames.

For tests, ``MINIFABRIC_CHECKPOINT_FAULT=POINT:RANK`` kills rank RANK with SIGKILL at POINT (one of
:data:`FAULT_POINTS`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minifabric import process
from minifabric.checkpoint.durable import fsync_path, replacing
from minifabric.checkpoint.errors import CheckpointError

POINTER = "LATEST"
RECORD = "COMMIT.json"
FORMAT_NAME = "minifabric-sharded"
PARTIAL = ".partial-"
REMOVING = ".removing-"  # beside a checkpoint folder: what its last commit replaced, being deleted
FAULT_ENV = "MINIFABRIC_CHECKPOINT_FAULT"
FAULT_POINTS = (
    "before_shard",
    "after_shard",
    "before_commit",
    "after_commit_record",
    "after_rename",
    "after_pointer_tmp",
    "after_pointer",
    "after_cleanup",
    "after_file_aside",
)


def fault(point: str, rank: int) -> None:
    """Kill this process at ``point`` if ``MINIFABRIC_CHECKPOINT_FAULT`` asks for it (fault injection)."""
    wanted = os.environ.get(FAULT_ENV, "")
    if wanted and wanted in (point, f"{point}:{rank}"):
        os.kill(os.getpid(), signal.SIGKILL)


def _aside_prefix(path: Path) -> str:
    """Name prefix of a one-file checkpoint moved aside while a folder replaces it."""
    return f".{path.name}.previous-"


_VERSION = re.compile(r"v(\d{6})-[0-9a-f]{8}")


def _owned(name: str) -> bool:
    """Whether an entry of a checkpoint folder is one minifabric writes."""
    return name in (POINTER, f".{POINTER}.tmp") or name.startswith(PARTIAL) or bool(_VERSION.fullmatch(name))


def target_error(path: Path) -> str | None:
    """Why a sharded checkpoint cannot be saved to ``path``, or None (checked on rank 0 before writing)."""
    if path.is_dir() and not (path / POINTER).is_file() and not (path / RECORD).is_file():
        if not all(_owned(p.name) for p in path.iterdir()):
            return (
                f"Refusing to replace {str(path)!r}: it is a folder that holds no minifabric checkpoint."
                " Save to a new path or remove that folder first."
            )
    if path.exists() and not path.is_dir() and not path.is_file():
        return f"Cannot save a sharded checkpoint to {str(path)!r}: it is neither a folder nor a file."
    return unwritable_parent_error(path)


def unwritable_parent_error(path: Path) -> str | None:
    """Why nothing can be created at ``path`` (its nearest existing ancestor is not writable), or None."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"Cannot save to {str(path)!r}: {str(parent)!r} is not a writable directory. Pick a writable location."
    return None


@dataclass
class Staging:
    """Where a save writes (``work``) and the checkpoint folder it commits into (``container``)."""

    path: Path
    container: Path
    work: Path
    created: bool  # the container did not exist before this save

    @property
    def replaces_file(self) -> bool:
        """Whether the checkpoint folder is built next to a one-file checkpoint it will replace."""
        return self.container != self.path


def make_staging(path: Path) -> Staging:
    """Create a fresh staging folder for a save to ``path`` (rank 0)."""
    token = uuid.uuid4().hex[:8]
    container = path.parent / f".{path.name}{PARTIAL}{token}" if path.is_file() else path
    created = not container.exists()
    container.mkdir(parents=True, exist_ok=True)
    work = container / f"{PARTIAL}{token}"
    work.mkdir()
    return Staging(path, container, work, created)


def write_record(folder: Path, world_size: int) -> dict[str, Any]:
    """Write the commit record into ``folder`` (rank 0, after every rank finished); return it."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != RECORD}
    record = {
        "format": FORMAT_NAME,
        "version": 1,
        "world_size": world_size,
        "created": time.time(),
        "files": files,
    }
    with replacing(folder / RECORD, "w", tmp_name=f".{RECORD}.tmp") as f:
        json.dump(record, f, indent=1)
    return record


def _next_version(container: Path) -> str:
    numbers = [int(m.group(1)) for p in container.iterdir() if (m := _VERSION.fullmatch(p.name))]
    return f"v{max(numbers, default=0) + 1:06d}-{uuid.uuid4().hex[:8]}"


def commit(staging: Staging, world_size: int, rank: int = 0) -> None:
    """Make the finished ``staging.work`` the checkpoint at ``staging.path`` (rank 0; see the module doc)."""
    fault("before_commit", rank)

    def after_tmp() -> None:
        fault("after_pointer_tmp", rank)

    write_record(staging.work, world_size)
    fault("after_commit_record", rank)
    version = staging.container / _next_version(staging.container)
    os.rename(staging.work, version)
    fsync_path(staging.container)
    fault("after_rename", rank)
    pointer_tmp = f".{POINTER}.tmp"
    with replacing(staging.container / POINTER, "w", tmp_name=pointer_tmp, before_replace=after_tmp) as f:
        f.write(version.name)
    fault("after_pointer", rank)
    if staging.replaces_file:
        aside = staging.path.parent / f"{_aside_prefix(staging.path)}{uuid.uuid4().hex[:8]}"
        os.rename(staging.path, aside)
        fault("after_file_aside", rank)
        os.rename(staging.container, staging.path)
        fsync_path(staging.path.parent)
    if staging.replaces_file:
        remove_stale(staging.path, keep=version.name)  # the file moved aside lies next to path: gone now
    else:
        _clean_up_later(staging.path, keep=version.name)
    fault("after_cleanup", rank)


def abort(staging: Staging) -> None:
    """Remove a staging folder after a failed save (rank 0); the committed checkpoint is untouched."""
    shutil.rmtree(staging.container if staging.created else staging.work, ignore_errors=True)


def _stale(path: Path, keep: str | None) -> list[Path]:
    """Everything of ``path`` but ``LATEST`` and version ``keep``, and what a replaced file left beside it."""
    inside = [
        e
        for e in (path.iterdir() if path.is_dir() else ())
        if e.name not in (POINTER, keep) and _owned(e.name)
    ]
    beside = _beside(path, _aside_prefix(path), f".{path.name}{PARTIAL}", f".{path.name}{REMOVING}")
    return inside + beside


def _beside(path: Path, *prefixes: str) -> list[Path]:
    """The entries next to ``path`` whose names start with one of ``prefixes``.

    Compared as text, not as a glob pattern: a checkpoint's name may hold ``[``, ``*`` or ``?``
    (``run[lr=0.1].pt``).
    """
    parent = path.parent
    return sorted(p for p in parent.iterdir() if p.name.startswith(prefixes)) if parent.is_dir() else []


def _remove(entries: list[Path]) -> None:
    """Delete ``entries`` (folders with what they hold); what cannot be deleted stays for the next commit."""
    for entry in entries:
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        except OSError:
            pass  # a later commit's clean-up tries again; the checkpoint itself is committed


def remove_stale(path: Path, keep: str | None = None) -> None:
    """Delete everything of ``path`` but ``LATEST`` and version ``keep`` (rank 0, after a commit)."""
    _remove(_stale(path, keep))


def _set_aside(path: Path, entries: list[Path]) -> list[Path]:
    """Move the ``entries`` inside ``path`` into a new ``.NAME.removing-*`` folder beside it; return what to delete.

    Renames only (no data is touched), so ``path`` holds just ``LATEST`` and the committed version
    at once. An entry that cannot be moved (another file system, no permission) is deleted where it
    is, now, as far as it can be.
    """
    inside = [e for e in entries if e.parent == path]
    beside = [e for e in entries if e.parent != path]
    if not inside:
        return beside
    trash = path.parent / f".{path.name}{REMOVING}{uuid.uuid4().hex[:8]}"
    try:
        trash.mkdir()
    except OSError:
        _remove(inside)
        return beside
    for entry in inside:
        try:
            os.rename(entry, trash / entry.name)
        except OSError:
            _remove([entry])
    return [trash, *beside]


_CLEANUP = "minifabric-checkpoint-cleanup"  # one per process: a background save's commit and another thread's save may both get here


def _clean_up_later(path: Path, keep: str) -> None:
    """Remove what the commit of version ``keep`` replaced at ``path``: set aside now, deleted on a thread.

    Rank 0, after the commit. The entries are listed and set aside now, after the previous deletion
    ended, so a save started later never loses its staging folder to it. The thread is not a daemon:
    the interpreter finishes the deletion before it exits; a process killed first leaves the
    ``.NAME.removing-*`` folder for the next commit to remove (``load`` never reads it). Where no
    thread can start (a background save committing while Python 3.12 shuts down) it deletes here:
    the checkpoint is committed, and nothing after the commit may fail the save.
    """

    def prepare() -> Callable[[], None] | None:
        doomed = _set_aside(path, _stale(path, keep))
        return functools.partial(_remove, doomed) if doomed else None

    process.run_chore(_CLEANUP, prepare)


def wait_for_cleanup() -> None:
    """Wait until the previous commit's older versions are deleted (a save calls it before it writes)."""
    process.wait_for_chore(_CLEANUP)


def _interrupted_hint(path: Path) -> str:
    partial = sorted(path.glob(f"{PARTIAL}*")) if path.is_dir() else []
    if not partial:
        return ""
    return f" An interrupted save was found at {str(partial[0])!r}; it is never loaded."


def locate(path: Path) -> Path:
    """What holds the checkpoint saved at ``path``: a committed version folder, or a one-file checkpoint.

    Raises:
        CheckpointError: nothing was ever committed at ``path``.
    """
    if path.is_dir():
        pointer = path / POINTER
        if pointer.is_file():
            version = path / pointer.read_text().strip()
            if not version.is_dir():
                raise CheckpointError(
                    f"{str(pointer)!r} names {version.name!r}, which is missing: the checkpoint was changed"
                    " by hand. Point LATEST at a complete version folder in it."
                )
            return version
        if (path / RECORD).is_file():  # a version folder itself
            return path
        if path.name.startswith(PARTIAL) or any(path.glob(f"{PARTIAL}*")) or any(path.glob("*.distcp")):
            raise CheckpointError(
                f"{str(path)!r} was never committed: an interrupted save was found (no {POINTER})."
                f"{_interrupted_hint(path)} Load the last complete checkpoint instead."
            )
        raise CheckpointError(f"{str(path)!r} is not a minifabric checkpoint (no {POINTER} in that folder).")
    if path.exists():
        return path
    aside = _beside(path, _aside_prefix(path))
    if aside:  # a crash came while a folder replaced this one-file checkpoint
        return aside[0]
    raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.")


def verify(folder: Path) -> dict[str, Any]:
    """Check that ``folder`` is a committed, complete checkpoint version; return its commit record.

    Raises:
        CheckpointError: no commit record (an interrupted save), or files missing or of the wrong size.
    """
    record_path = folder / RECORD
    if not record_path.is_file():
        raise CheckpointError(
            f"{str(folder)!r} was never committed: an interrupted save was found (no {RECORD}). It is not"
            " loaded; load the last complete checkpoint instead."
        )
    try:
        record = json.loads(record_path.read_text())
        files = dict(record["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"The commit record {str(record_path)!r} is unreadable ({err}).") from err
    problems = []
    for name, size in files.items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, the commit record says {size}")
    if problems:
        raise CheckpointError(f"The checkpoint {str(folder)!r} is incomplete: " + "; ".join(problems) + ".")
    return record
