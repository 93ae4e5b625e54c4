"""Durable file writes: write to a temporary sibling, fsync, rename onto the target, fsync the folder.

Every file minifabric writes into a checkpoint goes through :func:`replacing`: after a crash the
target holds either its previous content or the new one, whole, on any POSIX file system (the
rename within one folder is atomic, and both fsyncs make it survive a power loss).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(
    path: Path,
    mode: str = "wb",
    *,
    tmp_name: str | None = None,
    before_replace: Callable[[], None] | None = None,
) -> Iterator[IO[Any]]:
    """Yield a file open on a temporary sibling of ``path``; on success make it ``path``, durably.

    ``tmp_name`` names the temporary file (default ``.{name}.tmp-{pid}``); ``before_replace`` runs
    between the fsync and the rename (a fault point of the commit protocol). On an exception the
    temporary file is removed and ``path`` is untouched.

    Example:
        >>> with replacing(Path("out.json"), "w") as f:  # doctest: +SKIP
        ...     f.write("{}")
    """
    tmp = path.with_name(tmp_name or f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
