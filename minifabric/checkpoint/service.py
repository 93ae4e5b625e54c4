"""The checkpoint service a strategy owns: one save or load at a time, synchronous or in the background.

``save`` gathers what to write on the calling thread (state dicts, each rank's RNG and stateful
states). For an asynchronous save a background thread then copies every tensor to CPU (the next
``optimizer.step()`` waits for that copy) and writes and commits the copy over the checkpoint's own
gloo group, while training goes on. A later save or load waits
for that write first; the thread is not a daemon, so the interpreter also waits for it at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from minifabric.checkpoint import full, restore, rng, sharded
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.hf.ties import tied_groups
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
        # step pre-hooks that hold optimizers back until an asynchronous save has copied the state
        self._hooks: list[RemovableHandle] = []

    @property
    def comm(self) -> Comm:
        """Collectives over the checkpoint's own process group (created on first use, on every rank)."""
        if self._comm is None:
            self._comm = Comm()
        return self._comm

    def wait(self) -> None:
        """Wait for an asynchronous save still in flight; raise if it failed."""
        pending, self._pending = self._pending, None
        hooks, self._hooks = self._hooks, []
        try:
            if pending is not None:
                pending.wait()
        finally:
            for hook in hooks:
                hook.remove()

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
            "tied": {k: tied_groups(v) for k, v in state.items() if entry_kinds[k] == "module"},
            "ranks": comm.gather(record),
        }
        if form == "sharded":
            tree, tensors = sharded.split_entries(collected, entry_kinds)
            side = {FORMAT_KEY: meta, "state": tree} if comm.is_zero else None
            if not asynchronous:
                sharded.write(comm, path, staging, side, tensors)
                return None
            side = stage(side)
            write = self._staged_write(state, tensors, lambda t: sharded.write(comm, path, staging, side, t))
        else:
            payload = {FORMAT_KEY: meta, "state": collected} if comm.is_zero else None
            if not asynchronous:
                full.write(comm, path, payload)
                return None
            write = self._staged_write(state, payload, lambda p: full.write(comm, path, p))
        self._pending = SaveHandle(path, write)
        return self._pending

    def _staged_write(
        self, state: dict[str, Any], tensors: Any, write: Callable[[Any], None]
    ) -> Callable[[], None]:
        """The background job of an asynchronous save: copy the tensors to CPU, then write the copy.

        The copy is taken on the background thread too, so ``save`` returns at once. Forward and
        backward only read parameters and optimizer state; ``optimizer.step()`` changes them in place,
        so until the copy is complete every optimizer in ``state`` waits for it before stepping.
        """
        copied = threading.Event()

        def hold_step(*_: Any) -> None:
            copied.wait()

        for obj in state.values():
            if isinstance(obj, Optimizer):
                self._hooks.append(obj.register_step_pre_hook(hold_step))

        def job() -> None:
            try:
                staged = stage(tensors, self._buffers)
            finally:
                copied.set()
            write(staged)

        return job

    def load(self, path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; return the entries it did not ask for."""
        self.wait()
        group = self.comm.group
        return restore.load(self._strategy, path, state, strict=strict, group=group)
