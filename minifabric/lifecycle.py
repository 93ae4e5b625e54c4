"""The life of one rank in a run: joining the process group, agreeing to stop, leaving it.

A :class:`Lifecycle` belongs to a strategy. It joins the default process group with the
collective timeout, creates two small gloo groups of its own (one to agree on ``should_stop``
after each optimizer step, one for the bounded barrier at exit), counts optimizer steps and
remembers the last committed checkpoint for the Ctrl-C message, and leaves the group at exit
unless the process is ending with an error.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from minifabric import collectives, signals, watchdog
from minifabric._torch import default_store
from minifabric.environment import destroy_process_group, exit_barrier_group, init_process_group
from minifabric.launcher import die_with_parent

#: environment variable: the collective timeout in seconds, where the strategy was not given one
TIMEOUT_VAR = "MINIFABRIC_TIMEOUT"


def collective_timeout(timeout: timedelta, explicit: bool) -> timedelta:
    """``timeout``, or ``MINIFABRIC_TIMEOUT`` seconds when the strategy was not given one."""
    value = os.environ.get(TIMEOUT_VAR)
    if explicit or not value:
        return timeout
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_VAR}={value!r} is not a number of seconds; e.g. {TIMEOUT_VAR}=600"
        ) from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_VAR}={value!r} must be positive; e.g. {TIMEOUT_VAR}=600")
    return timedelta(seconds=seconds)


class Lifecycle:
    """Joining, stopping and leaving for one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.steps = 0
        self._world_size = 1
        self._stop_agreed = False
        self._stop_group: dist.ProcessGroup | None = None
        self._exit_group: dist.ProcessGroup | None = None
        self._committed: Path | None = None
        self._pending: Any = None  # the handle of an asynchronous save in flight

    def prepare(self, rank: int, world_size: int) -> None:
        """Install the signal handling of a rank (Ctrl-C only with several processes)."""
        self._world_size = world_size
        if world_size > 1:
            signals.install(rank=rank, describe=self.describe)
            die_with_parent()
        else:
            signals.install_stop_signals()

    def join(self, environment: Any, backend: str, timeout: timedelta) -> None:
        """Join the default process group and create this lifecycle's own small groups."""
        init_process_group(environment, backend, timeout)
        signals.reclaim_excepthook()  # our hook labels the failing rank; exiting from it must stay possible
        self._world_size = dist.get_world_size()
        if self._world_size > 1:
            self._stop_group = dist.new_group(backend="gloo", timeout=timeout)
            self._exit_group = exit_barrier_group()
            watchdog.start(default_store(), dist.get_rank(), timeout.total_seconds())

    def leave(self) -> None:
        """Leave the process group together with the other ranks (bounded wait)."""
        watchdog.stop()
        destroy_process_group(self._exit_group)

    def leave_at_exit(self) -> None:
        """At interpreter exit: leave, unless this process ends with an error (nobody would wait)."""
        if not signals.ending_badly():
            self.leave()

    # ---- the loop ----------------------------------------------------------------------------

    def step_done(self) -> None:
        """After every optimizer step: agree on whether any rank was asked to stop (one tiny all-reduce)."""
        self.steps += 1
        if self._stop_group is not None:
            self._stop_agreed = collectives.any_rank(signals.stop_requested(), self._stop_group)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank (on this lifecycle's gloo group)."""
        return collectives.any_rank(flag, self._stop_group) if self._stop_group is not None else flag

    @property
    def should_stop(self) -> bool:
        """Whether any rank received SIGTERM or SIGUSR1 (as of the last optimizer step on every rank)."""
        signals.arm_stop()
        if self._world_size == 1:
            return signals.stop_requested()
        return self._stop_agreed

    def saving(self, path: Path, handle: Any) -> None:
        """Record a save: committed now (``handle`` None) or when its asynchronous write is done."""
        self._settle()
        if handle is None:
            self._committed, self._pending = path, None
        else:
            self._pending = handle

    def loaded(self, path: Path) -> None:
        """Record the checkpoint the run resumed from (the last committed one until the next save)."""
        if self._committed is None:
            self._committed = path

    def _settle(self) -> None:
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            if pending.error is None:
                self._committed = pending.path

    def describe(self) -> str:
        """``"at step N; last committed checkpoint: PATH"`` (the parts that are known)."""
        self._settle()
        parts = [f"at step {self.steps}"] if self.steps else []
        if self._committed is not None:
            parts.append(f"last committed checkpoint: {self._committed}")
        return "; ".join(parts)
