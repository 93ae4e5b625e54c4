"""The checkpoint service a strategy owns: one save or load at a time, synchronous or in the background.

``save`` gathers what to write on the calling thread (state dicts, each rank's RNG and stateful
states) and, for an asynchronous save, a CPU copy of every tensor; the files are then written and
committed on a background thread over the checkpoint's own gloo group. A later save or load waits
for that write first; the thread is not a daemon, so the interpreter also waits for it at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minifabric.checkpoint import full, restore, rng, sharded
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.state import FORMAT_KEY, FORMAT_VERSION, collect, kinds
from minifabric.checkpoint.tensors import stage

if TYPE_CHECKING:
    from minifabric.strategies.strategy import Strategy


class SaveHandle:
    """Returned by ``acc.save(..., asynchronous=True)``; ``wait()`` blocks until the checkpoint is committed.

    Example:
        >>> handle = acc.save("ckpt", state, asynchronous=True)  # doctest: +SKIP
        >>> ...  # keep training
        >>> handle.wait()  # doctest: +SKIP
    """

    def __init__(self, path: Path, write: Callable[[], None] | None = None) -> None:
        self.path = path
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if write is not None:
            self._thread = threading.Thread(
                target=self._run, args=(write,), name="minifabric-save", daemon=False
            )
            self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # re-raised by wait()
            self.error = err

    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is committed; raise :class:`CheckpointError` if writing it failed."""
        if self._thread is not None:
            self._thread.join()
        if isinstance(self.error, CheckpointError):
            raise self.error
        if self.error is not None:
            raise CheckpointError(
                f"The asynchronous save to {str(self.path)!r} failed: {self.error}"
            ) from self.error


class Checkpointer:
    """Saves and loads checkpoints for one strategy (the format follows ``strategy.state_dict_type``)."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._comm: Comm | None = None
        self._pending: SaveHandle | None = None
        # CPU copies of the last asynchronous save, reused by the next one (one model copy in RAM).
        self._buffers: dict[str, Any] = {}

    @property
    def comm(self) -> Comm:
        """Collectives over the checkpoint's own process group (created on first use, on every rank)."""
        if self._comm is None:
            self._comm = Comm()
        return self._comm

    def wait(self) -> None:
        """Wait for an asynchronous save still in flight; raise if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save(self, path: Path, state: dict[str, Any], *, asynchronous: bool = False) -> SaveHandle | None:
        """Write ``state`` to ``path`` (collective: every rank calls it)."""
        self.wait()
        comm = self.comm
        form = self._strategy.state_dict_type
        if form not in ("full", "sharded"):
            raise ValueError(f'state_dict_type={form!r} is not supported. Use "sharded" or "full".')
        if form == "sharded":
            staging = sharded.prepare(comm, path)
        else:
            full.check_target(comm, path)
        entry_kinds = kinds(state)
        collected = collect(self._strategy, state)
        record = {
            "rng": rng.capture(),
            "stateful": {k: collected.pop(k) for k, kind in entry_kinds.items() if kind == "stateful"},
        }
        meta = {
            "version": FORMAT_VERSION,
            "format": form,
            "world_size": comm.world_size,
            "kinds": entry_kinds,
            "ranks": comm.gather(record),
        }
        if form == "sharded":
            tree, tensors = sharded.split_entries(collected, entry_kinds)
            side = {FORMAT_KEY: meta, "state": tree} if comm.is_zero else None
            if asynchronous:
                side, tensors = stage(side), stage(tensors, self._buffers)
            write = lambda: sharded.write(comm, path, staging, side, tensors)  # noqa: E731
        else:
            payload = {FORMAT_KEY: meta, "state": collected} if comm.is_zero else None
            if asynchronous:
                payload = stage(payload, self._buffers)
            write = lambda: full.write(comm, path, payload)  # noqa: E731
        if not asynchronous:
            write()
            return None
        self._pending = SaveHandle(path, write)
        return self._pending

    def load(self, path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; return the entries it did not ask for."""
        self.wait()
        group = self.comm.group
        return restore.load(self._strategy, path, state, strict=strict, group=group)
