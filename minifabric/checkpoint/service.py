"""The checkpoint service: one save or load at a time, synchronous or in the background.

The facade owns one :class:`Checkpointer` and passes it, on every save, the strategy's
:class:`~minifabric.checkpoint.options.CheckpointOptions` (sharded or full): the service never sees
the strategy.

``save`` gathers what to write on the calling thread (state dicts, each rank's RNG and stateful
states). For an asynchronous save a background thread then copies every tensor to CPU (the next
``optimizer.step()``, and the next forward of a module with buffers, wait for that copy) and writes
and commits the copy over the checkpoint's own gloo group, while training goes on. A later save or load waits
for that write first; the thread is not a daemon, so the interpreter also waits for it at exit.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from minifabric._torch import hold_state_changes
from minifabric.checkpoint import commit, full, periodic, restore, rng, sharded
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.hf.ties import tied_groups
from minifabric.checkpoint.options import CheckpointOptions
from minifabric.checkpoint.state import FORMAT_KEY, FORMAT_VERSION, collect, kinds, refuse_unloadable
from minifabric.checkpoint.tensors import stage


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
    """Saves and loads checkpoints (the format of a save follows its ``CheckpointOptions``).

    Every phase of a save or load ends with an agreement between the ranks (:meth:`Comm.agree`): an
    exception on any rank makes every rank raise the same :class:`CheckpointError`, the staging
    folder is removed, and nothing is committed or applied.
    """

    def __init__(self) -> None:
        self._comm: Comm | None = None
        self._pending: SaveHandle | None = None
        # CPU copies of the last asynchronous save, reused by the next one (one model copy in RAM).
        self._buffers: dict[str, Any] = {}
        # hooks that hold optimizer steps and buffer-updating forwards until an async save has copied
        self._hooks: list[Any] = []

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

    def save(
        self,
        path: Path,
        state: dict[str, Any],
        options: CheckpointOptions,
        *,
        asynchronous: bool = False,
        keep_last: int | None = None,
    ) -> SaveHandle | None:
        """Write ``state`` to ``path`` (collective: every rank calls it); then apply ``keep_last`` retention."""
        self.wait()
        comm = self.comm
        form = options.state_dict_type
        if form not in ("full", "sharded"):
            raise ValueError(f'state_dict_type={form!r} is not supported. Use "sharded" or "full".')
        context = f"Saving the checkpoint {str(path)!r} failed"
        outcome = "; the previous checkpoint at that path is intact."
        entry_kinds = kinds(state)
        staging: commit.Staging | None = None

        def agree(error: BaseException | None) -> None:
            try:
                comm.agree(error, context, outcome)
            except CheckpointError:
                if staging is not None:
                    commit.abort(staging)
                comm.barrier()  # every rank raises once the staging folder is gone
                raise

        # 1. local checks, no collectives: the target (rank 0), the values, stateful objects' states
        error, record = None, None
        try:
            if comm.is_zero:
                if form == "sharded":
                    staging = sharded.prepare(path)
                elif message := full.writable_file_error(path):
                    raise CheckpointError(message)
            stateful = {k: state[k].state_dict() for k, kind in entry_kinds.items() if kind == "stateful"}
            values = {f"state[{k!r}]": v for k, v in state.items() if entry_kinds[k] == "value"}
            values.update({f"state[{k!r}].state_dict()": v for k, v in stateful.items()})
            refuse_unloadable(values)
            record = {"rng": rng.capture(), "stateful": stateful}
        except Exception as err:
            error = err
        agree(error)
        work = comm.broadcast(staging.work if staging is not None else None)

        # 2. state dicts (collective under FSDP with a full checkpoint)
        error = None
        payload: Any = None
        try:
            stateful = record["stateful"]  # type: ignore[index]
            collected = collect(state, stateful, form == "full", comm.rank, comm.world_size)
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
                payload = (tensors, {FORMAT_KEY: meta, "state": tree} if comm.is_zero else None)
            else:
                payload = (None, {FORMAT_KEY: meta, "state": collected} if comm.is_zero else None)
        except Exception as err:
            error = err
        agree(error)

        # 3. write every rank's part, agree, then commit (rank 0) and agree
        def write(staged: tuple[Any, Any]) -> None:
            tensors, side = staged
            error = None
            try:
                if form == "sharded":
                    sharded.write_shards(comm, Path(work), tensors)
                elif comm.is_zero:
                    full.write_atomic(path, side)
                    commit.remove_stale(path)  # what an interrupted save left next to it
            except BaseException as err:  # DCP's CheckpointException derives from BaseException
                error = err
            agree(error)
            error = None
            try:
                if form == "sharded" and staging is not None:
                    sharded.commit_side(staging, side, comm.world_size)
            except Exception as err:
                error = err
            agree(error)
            if keep_last is not None and comm.is_zero:  # only now that the new one is committed
                try:
                    periodic.retain(path, keep_last)
                except OSError as err:  # the save itself succeeded
                    warnings.warn(
                        f"Removing older checkpoints next to {str(path)!r} failed: {err}", stacklevel=2
                    )

        if not asynchronous:
            write(payload)  # type: ignore[arg-type]
            return None
        self._pending = SaveHandle(path, self._staged_write(state, payload, write))
        return self._pending

    def _staged_write(
        self, state: dict[str, Any], payload: Any, write: Callable[[Any], None]
    ) -> Callable[[], None]:
        """The background job of an asynchronous save: copy the tensors to CPU, then write the copy.

        The copy is taken on the background thread too, so ``save`` returns at once. Until it is
        complete, every optimizer step and the forward of every module in ``state`` that holds
        buffers (BatchNorm statistics) waits for it: the checkpoint is the state at the call.
        """
        copied = threading.Event()
        self._hooks += hold_state_changes(copied, [v for v in state.values() if isinstance(v, nn.Module)])

        def job() -> None:
            try:
                staged = stage(payload, self._buffers)
            finally:
                copied.set()
            write(staged)

        return job

    def load(self, path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Restore ``state`` in place from ``path``; return the entries it did not ask for."""
        self.wait()
        return restore.load(path, state, strict=strict, comm=self.comm)

    def load_raw(self, path: Path, obj: Any, strict: bool = True, key_map: Any = None) -> None:
        """Load a plain state-dict file, a consolidated checkpoint or Hugging Face safetensors into ``obj``."""
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
        full.load_raw(path, obj, strict=strict)

    def export_safetensors(self, path: Path, module: nn.Module) -> None:
        """Write ``module``'s weights as Hugging Face safetensors at ``path`` (every rank calls, rank 0 writes)."""
        from minifabric.checkpoint import hf

        self.wait()
        hf.export_module(self.comm, module, path)
