"""The life of one rank in a run: joining the process group, agreeing to stop, leaving it.

A :class:`Lifecycle` belongs to a strategy. It joins the default process group with the
collective timeout, creates two small gloo groups of its own (one for the stop agreement, one for
the bounded barrier at exit), counts optimizer steps and remembers the last committed checkpoint
for the Ctrl-C message, starts the hang watchdog and the heartbeat (:mod:`minifabric.heartbeat`),
and leaves the group at exit unless the process is ending with an error.

The stop agreement is the read of ``should_stop`` itself: with several processes it is one tiny
all-reduce on the stop group, so every rank must read it at the same point of the loop (as every
rank calls ``all_reduce`` at the same point). Inside a Ray Train (v2) worker the read also calls
``ray.train.get_preemption_info()`` once, on every rank (:mod:`minifabric.ray_train`). Nothing else
communicates for it: ``optimizer.step()`` stays local.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from minifabric import collectives, heartbeat, ray_train, rendezvous, signals, watchdog
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
        self._stop_reads = 0  # how often this process read should_stop (signals.py asks)
        self._stop_group: dist.ProcessGroup | None = None
        self._preempted: Callable[[], bool] | None = None  # Ray Train's notice (decided at the first read)
        self._exit_group: dist.ProcessGroup | None = None
        self._committed: Path | None = None
        self._pending: Any = None  # the handle of an asynchronous save in flight

    def prepare(self, rank: int, world_size: int) -> None:
        """Install the signal handling of a rank (Ctrl-C only with several processes).

        The preemption handlers (SIGTERM, SIGUSR1) are armed here, at launch: a signal is held for
        the next read of ``should_stop`` once the loop has read it at least once; before that it
        ends the process as it would without minifabric.
        """
        self._world_size = world_size
        if world_size > 1:
            signals.install(rank=rank, describe=self.describe)
            die_with_parent()
        else:
            signals.install_stop_signals()
        signals.hold_stop_signals_while(lambda: self._stop_reads > 0)

    def join(self, environment: Any, backend: str, timeout: timedelta) -> None:
        """Join the default process group and create this lifecycle's own small groups."""
        init_process_group(environment, backend, timeout)
        signals.reclaim_excepthook()  # our hook labels the failing rank; exiting from it must stay possible
        self._world_size = dist.get_world_size()
        if self._world_size > 1:
            self._stop_group = dist.new_group(backend="gloo", timeout=timeout)
            self._exit_group = exit_barrier_group()
            watchdog.start(default_store(), dist.get_rank(), timeout.total_seconds())
            heartbeat.start(default_store(), dist.get_rank(), self._world_size, rendezvous.store_host())

    def leave(self) -> None:
        """Leave the process group together with the other ranks (bounded wait)."""
        watchdog.stop()
        heartbeat.stop()
        destroy_process_group(self._exit_group)

    # ---- the loop ----------------------------------------------------------------------------

    def step_done(self) -> None:
        """After every optimizer step: count it (local; for the Ctrl-C message)."""
        self.steps += 1

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank (on this lifecycle's gloo group)."""
        return collectives.any_rank(flag, self._stop_group) if self._stop_group is not None else flag

    def should_stop(self) -> bool:
        """Whether any rank received SIGTERM or SIGUSR1, or Ray Train reports a preemption.

        Every rank must call it at the same point of the loop: it is one all-reduce of a single
        integer on this lifecycle's gloo group, and inside a Ray Train (v2) worker one call of
        ``ray.train.get_preemption_info()`` (Ray's own collective, the same answer on every worker).
        """
        if self._stop_reads == 0:
            self._preempted = ray_train.preemption_reader()
        self._stop_reads += 1
        if self._stop_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            # a process group this lifecycle did not create (adopted): every rank is at this same
            # read, so the small gloo group can be made here
            self._stop_group = dist.new_group(backend="gloo")
        # called on every read (never skipped by a signal already received): Ray counts the calls
        preempted = self._preempted is not None and self._preempted()
        return self.any_rank(signals.stop_requested() or preempted)

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
