"""Periodic checkpoints: find the newest committed one under a folder, and keep only the last K.

A run that saves every N steps to ``ckpts/step-000100``, ``ckpts/step-000200``, ... resumes from
``latest_checkpoint("ckpts")`` and bounds its disk use with ``acc.save(..., keep_last=3)``.
Retention removes older checkpoints of the same series (sibling names that differ only in their
digits) and only after the new one is committed, so a crash never leaves fewer than the last K.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from minifabric.checkpoint.commit import POINTER, RECORD, locate, remove_stale
from minifabric.checkpoint.errors import CheckpointError

#: Suffixes of one-file checkpoints that :func:`latest_checkpoint` and retention consider.
FILE_SUFFIXES = (".pt", ".pth", ".ckpt")
#: ``torch.save`` writes a zip archive: a one-file checkpoint saved without a suffix starts with this.
_TORCH_ARCHIVE = b"PK\x03\x04"


def _is_checkpoint_file(path: Path) -> bool:
    if path.suffix in FILE_SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == _TORCH_ARCHIVE
    except OSError:
        return False


def _committed_at(path: Path) -> float | None:
    """When the checkpoint at ``path`` was committed, or None if it is no committed checkpoint."""
    if path.name.startswith("."):  # staging folders and temporary files of a save in progress
        return None
    if path.is_file():
        return path.stat().st_mtime if _is_checkpoint_file(path) else None
    if not (path / POINTER).is_file():
        return None
    try:
        version = locate(path)
        return float(json.loads((version / RECORD).read_text())["created"])
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return None


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The most recently committed checkpoint directly under ``folder``, or None if there is none.

    Sharded checkpoint folders count once committed; one-file checkpoints count by their suffix
    (``.pt``, ``.pth``, ``.ckpt``) or, without one, by ``torch.save``'s archive header. An
    interrupted save is never returned.

    Example:
        >>> from minifabric import latest_checkpoint
        >>> path = latest_checkpoint("checkpoints")  # doctest: +SKIP
        >>> if path is not None:  # doctest: +SKIP
        ...     acc.load(path, state)
    """
    root = Path(folder)
    if not root.is_dir():
        return None
    found = [(t, p.name, p) for p in root.iterdir() if not p.name.startswith(".") and (t := _committed_at(p))]
    return max(found)[2] if found else None


def _series(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def retain(path: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints of ``path``'s series (rank 0, after its commit).

    Returns what was deleted. ``path`` itself is never deleted. A sharded checkpoint loses its
    ``LATEST`` pointer first, so one deleted half-way is never loaded. What a crash left beside a
    deleted checkpoint (``.NAME.removing-*``, ``.NAME.partial-*``) goes with it.
    """
    series = _series(path.name)
    found = [
        (t, p.name, p)
        for p in path.parent.iterdir()
        if p != path and _series(p.name) == series and (t := _committed_at(p)) is not None
    ]
    doomed = [p for _, _, p in sorted(found, reverse=True)[max(keep_last - 1, 0) :]]
    for old in doomed:
        if old.is_dir():
            (old / POINTER).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
        remove_stale(old)
    return doomed
