"""The checkpoint's own process group, its object collectives, and the agreement that ends every phase.

Checkpoint traffic runs on a separate gloo group, created once per strategy on the first save, so
an asynchronous save that is still writing in a background thread never interleaves its
collectives with the training loop's collectives on the default group.

Every phase of a save or load runs inside :meth:`Comm.agreed`: an exception on any rank makes
every rank raise the same :class:`CheckpointError` at the end of the phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from minifabric import collectives
from minifabric.checkpoint.errors import CheckpointError, UnsaveableValueError


def describe(err: BaseException) -> str:
    """The message of ``err`` for the other ranks: each failing rank's cause for DCP's exception."""
    if isinstance(err, CheckpointError):
        return str(err)
    failures = getattr(err, "failures", None)  # DCP's CheckpointException
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


class Comm:
    """Rank, world size and object collectives over the checkpoint group (identity with one process)."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # new_group is itself a collective: every rank creates it here, in the same save call.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self._mesh: Any = None

    @property
    def is_zero(self) -> bool:
        """Whether this is global rank 0 (which decides paths and writes the commit record)."""
        return self.rank == 0

    def mesh(self) -> Any:
        """A one-dimensional CPU device mesh over the checkpoint group (for tensors read sharded)."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, "cpu")  # type: ignore[arg-type]  # None: the default group
        return self._mesh

    def barrier(self) -> None:
        """Wait for every rank (on the checkpoint group)."""
        if self.distributed:
            dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank."""
        return collectives.broadcast_object(obj, 0, self.group) if self.distributed else obj

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's object, in rank order, on rank 0 (None elsewhere)."""
        return collectives.gather_object(obj, 0, self.group) if self.distributed else [obj]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        return collectives.all_gather_object(obj, self.group) if self.distributed else [obj]

    @contextmanager
    def agreed(
        self,
        context: str,
        outcome: str = "",
        on_failure: Callable[[], None] | None = None,
        shared: dict[str, Any] | None = None,
    ) -> Iterator[None]:
        """Run the body of one phase, then agree on its outcome (collective: every rank enters it).

        Whatever the body raises (any exception: DCP's derives from ``BaseException``) is shared;
        if any rank failed, ``on_failure`` runs on every rank (e.g. removing a staging folder) and
        every rank raises the same :class:`CheckpointError` (see :meth:`agree`). With ``shared``,
        the agreement also carries ``shared["value"]`` (set by the body) from every rank: after it,
        ``shared["all"]`` lists them in rank order (one collective for both).

        Example:
            >>> with comm.agreed("Loading 'ckpt' failed", "; nothing was changed."):  # doctest: +SKIP
            ...     opened = read.open_checkpoint(path)
        """
        error: BaseException | None = None
        try:
            yield
        except BaseException as err:  # shared with the other ranks below, whatever it is
            error = err
        try:
            values = self.agree(error, context, outcome, shared.get("value") if shared is not None else None)
        except CheckpointError:
            if on_failure is not None:
                on_failure()
            raise
        if shared is not None:
            shared["all"] = values

    def agree(
        self, error: BaseException | None, context: str = "", outcome: str = "", value: Any = None
    ) -> list[Any]:
        """Raise the same error on every rank if any rank failed (collective: every rank must call it).

        A :class:`CheckpointError` keeps its own message; any other failure becomes
        ``"{context} (rank 1: ValueError: ...){outcome}"``, naming each failing rank's cause once. A
        refused ``state`` value raises :class:`UnsaveableValueError` (also a ``TypeError``). Returns
        every rank's ``value``, in rank order.
        """
        if isinstance(error, KeyboardInterrupt):
            raise error
        mine = None
        if isinstance(error, CheckpointError):
            mine = (isinstance(error, UnsaveableValueError), True, str(error))
        elif error is not None:
            text = describe(error)
            if getattr(error, "failures", None) is None:
                text = f"rank {self.rank}: {text}"
            mine = (False, False, text)
        gathered = self.all_gather((mine, value))
        failed = [e for e, _ in gathered if e is not None]
        if not failed:
            return [v for _, v in gathered]
        own = list(dict.fromkeys(text for _, is_own, text in failed if is_own))
        causes = list(dict.fromkeys(text for _, is_own, text in failed if not is_own))
        if causes:
            own.append(f"{context} ({'; '.join(causes)}){outcome}")
        cls = UnsaveableValueError if all(value for value, _, _ in failed) else CheckpointError
        raise cls(" | ".join(own)) from error
