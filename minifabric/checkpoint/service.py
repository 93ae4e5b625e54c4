"""The checkpoint service: one save or load at a time, synchronous or in the background.

The facade owns one :class:`Checkpointer` and passes it, on every save, the strategy's
``state_dict_type`` (``"sharded"`` or ``"full"``), a plain string: the service never sees the
strategy, and strategies import nothing from ``checkpoint/``.

A save is ``saving.prepare -> collect -> write -> commit`` (``save.py``), a load is ``load.load``
(``load.py``). For an asynchronous save, ``prepare`` and ``collect`` run on the calling thread,
which then copies every tensor of the state to CPU before the call returns (the checkpoint is the
state at the call, whatever changes in place afterwards; CUDA tensors are copied on a side stream
that the call does not wait for, see ``staging.py``); a background thread waits for that copy,
agrees on it and writes and commits it over the checkpoint's own gloo group, while training goes on. A later
save or load waits for that write first; at exit a failure nobody saw is printed on every rank
and the exit status is 1.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifabric import process
from minifabric.checkpoint import load as loading
from minifabric.checkpoint import raw
from minifabric.checkpoint import save as saving
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.staging import Staging, stage


class SaveHandle:
    """Returned by ``acc.save(..., asynchronous=True)``; ``wait()`` blocks until the checkpoint is committed.

    ``staged`` maps each route of the copy taken at the call (``"cpu"``, ``"page-locked"``,
    ``"device"``, ``"pageable"``) to the bytes it copied.

    Example:
        >>> handle = acc.save("ckpt", state, asynchronous=True)  # doctest: +SKIP
        >>> ...  # keep training
        >>> handle.wait()  # doctest: +SKIP
    """

    def __init__(
        self, path: Path, write: Callable[[], None] | None = None, staged: dict[str, int] | None = None
    ) -> None:
        self.path = path
        self.staged = {} if staged is None else staged
        self.error: BaseException | None = None
        self.reported = False  # whether wait() raised the failure to someone
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
        if self.error is not None:
            self.reported = True
        if isinstance(self.error, CheckpointError):
            raise self.error
        if self.error is not None:
            raise CheckpointError(
                f"The asynchronous save to {str(self.path)!r} failed: {self.error}"
            ) from self.error


def _failed(error: Exception) -> Callable[[], saving.Payload]:
    """What gives the background thread a save whose copy failed: the error alone, for the agreement."""
    failed = saving.Payload(None, None, (error, None))
    return lambda: failed


class _LastSave:
    """A checkpointer's last asynchronous save, which the exit hook reports if it failed unseen.

    The hook holds this, not the checkpointer: the checkpointer's kept copies (a copy of the
    state, page-locked on a GPU) go with it, not at interpreter exit.
    """

    def __init__(self, end_process: Callable[[int], Any]) -> None:
        self.handle: SaveHandle | None = None
        self.rank = 0
        self.end_process = end_process

    def report_at_exit(self) -> None:
        """At interpreter exit (the save thread has ended): a failed background save nobody saw fails the process.

        Every rank prints the failure in one line (the agreement made it the same everywhere) and
        exits with status 1, after the other exit handlers ran.
        """
        pending, self.handle = self.handle, None
        if pending is None or pending.reported:
            return
        try:
            pending.wait()
        except CheckpointError as err:
            process.write_stderr(f"[minifabric] rank {self.rank}: the asynchronous save did not complete: {err}\n")
            self.end_process(1)


class Checkpointer:
    """Saves and loads checkpoints (the format of a save follows the strategy's ``state_dict_type``).

    Every stage of a save or load ends with an agreement between the ranks (:meth:`Comm.agreed`):
    an exception on any rank makes every rank raise the same :class:`CheckpointError`, the staging
    folder is removed, and nothing is committed or applied.

    Args:
        end_process: ends this process with the given exit status (marked as failed) after the other exit
            handlers: the report of a background save that failed unseen. The facade passes the runtime's.
    """

    def __init__(self, end_process: Callable[[int], Any] = process.end) -> None:
        self._comm: Comm | None = None
        self._last = _LastSave(end_process)  # what the exit hook holds: not the copies below
        # CPU copies of the last asynchronous save, reused by the next one (one model copy in RAM).
        self._staging = Staging()
        self._exit_hook: Callable[[], None] | None = None  # cancels the exit hook

    @property
    def comm(self) -> Comm:
        """Collectives over the checkpoint's own process group (created on first use, on every rank)."""
        if self._comm is None:
            self._comm = Comm()
        return self._comm

    def wait(self) -> None:
        """Wait for an asynchronous save still in flight; raise if it failed."""
        pending, self._last.handle = self._last.handle, None
        if pending is not None:
            pending.wait()

    def save(
        self,
        path: Path,
        state: dict[str, Any],
        state_dict_type: str,
        *,
        asynchronous: bool = False,
        keep_last: int | None = None,
        filter: saving.Filter | None = None,
    ) -> SaveHandle | None:
        """Write ``state`` to ``path`` (collective: every rank calls it); then apply ``keep_last`` retention.

        ``filter`` maps entries of ``state`` to ``(key, value) -> bool``: only the items of that
        entry's state dict for which it returns True are saved (Lightning Fabric's ``filter``).
        """
        saving.check_filter(filter, state)
        self.wait()
        form = state_dict_type
        if form not in ("full", "sharded"):
            raise ValueError(f'state_dict_type={form!r} is not supported. Use "sharded" or "full".')
        # Under `torch.inference_mode()` a sharded model's state_dict() fails (a DTensor's detach),
        # and the CPU copies, kept for the next save, would be inference tensors it cannot write into.
        with torch.inference_mode(False), torch.no_grad():
            job, record = saving.prepare(self.comm, path, state, form, keep_last, filter or {})
            payload = saving.collect(job, state, record, agree=not asynchronous)
            if not asynchronous:
                saving.write(job, payload)
                saving.commit(job, payload)
                return None
            copied, routes = self._snapshot(payload)

        def in_background() -> None:
            agreed = saving.agree_collected(job, copied())  # a copy failed on one rank fails it on every rank
            saving.write(job, agreed)
            saving.commit(job, agreed)

        self._last.handle, self._last.rank = SaveHandle(path, in_background, routes), self.comm.rank
        if self._exit_hook is None:
            self._exit_hook = process.at_exit(self._last.report_at_exit)
        return self._last.handle

    def _snapshot(self, payload: saving.Payload) -> tuple[Callable[[], saving.Payload], dict[str, int]]:
        """A CPU copy of everything ``payload`` holds, as of the call: what gives it, and the bytes by route.

        The tensors, the side record and this rank's record (stateful objects' state dicts) are
        copied, so nothing training does afterwards (``optimizer.step()``, an update by hand, a
        tensor among ``state``'s values changed in place) reaches the checkpoint. The copies reuse
        the previous save's buffers. The returned function, called by the background thread, waits
        for the copies still running on a device and gives the payload to write. A failure is kept
        for the agreement, which raises it on every rank (carrying no record: the background thread
        reads nothing of the live state, which training changes meanwhile); Ctrl-C (or
        ``SystemExit``) while collecting or copying is raised here, on the calling thread.
        """
        error, record = payload.pending
        if error is not None and not isinstance(error, Exception):
            raise error
        if error is not None:
            return _failed(error), {}
        try:
            snapshot = stage((payload.tensors, payload.record, record), self._staging)
        except Exception as err:  # raised on every rank by the agreement
            return _failed(err), {}

        def copied() -> saving.Payload:
            try:
                tensors, tree, rank_record = snapshot.take()
            except Exception as err:  # raised on every rank by the agreement
                return _failed(err)()
            return saving.Payload(tensors, tree, (None, rank_record))

        return copied, dict(snapshot.routes)

    def load(
        self, path: Path, state: dict[str, Any], strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; return the entries it did not ask for.

        ``weights_only=False`` lets a one-file checkpoint unpickle arbitrary classes, which runs
        code from the file: only for files you trust (None and True: never).
        """
        self.wait()
        return loading.load(
            path, state, strict=strict, comm=self.comm, weights_only=weights_only is not False
        )

    def load_raw(
        self,
        path: Path,
        obj: Any,
        strict: bool = True,
        key_map: Any = None,
        weights_only: bool | None = None,
        modules: Sequence[nn.Module] = (),
    ) -> None:
        """Load a plain state-dict file, a consolidated checkpoint or Hugging Face safetensors into ``obj``.

        ``modules`` (the set-up models) name an optimizer's parameters, for state keyed by name.
        """
        from minifabric.checkpoint import hf

        self.wait()
        if hf.is_safetensors(path):
            if not isinstance(obj, nn.Module):
                raise TypeError(f"Safetensors weights load into a module, got {type(obj).__name__}.")
            hf.load_safetensors(self.comm, path, obj, strict=strict, key_map=key_map)
            return
        if key_map is not None:
            raise ValueError(
                "key_map= applies to safetensors weights only; rename a state dict's keys yourself."
            )
        raw.load_raw(path, obj, strict=strict, weights_only=weights_only is not False, modules=modules)

    def export_safetensors(self, path: Path, module: nn.Module) -> None:
        """Write ``module``'s weights as Hugging Face safetensors at ``path`` (every rank calls, rank 0 writes)."""
        from minifabric.checkpoint import hf

        self.wait()
        hf.export_module(self.comm, module, path)
