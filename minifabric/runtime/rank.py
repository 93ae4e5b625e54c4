"""The life of this process as one rank of a run: joining the process group, agreeing to stop, leaving it.

A :class:`Rank` belongs to a strategy (``strategy.rank``). It joins the default process group with
the collective timeout, creates two small gloo groups of its own (one for the stop agreement, one
for the bounded barrier at exit), counts optimizer steps and remembers the last committed
checkpoint for the Ctrl-C message, starts the hang watcher (:mod:`minifabric.runtime.hang`) and the
heartbeat (:mod:`minifabric.runtime.heartbeat`), and leaves the group at exit unless the process is
ending with an error. *Leave* means only that: leave the run's process group together with the
other ranks (the heartbeat tells the peers that this rank left on purpose). A process that must
stop at once *ends* (:func:`end`).

The stop agreement is the read of ``should_stop`` itself: with several processes it is one tiny
all-reduce on the stop group, so every rank must read it at the same point of the loop (as every
rank calls ``all_reduce`` at the same point). Inside a Ray Train (v2) worker the read also calls
``ray.train.get_preemption_info()`` once, on every rank (:mod:`minifabric.runtime.ray`). Nothing
else communicates for it: ``optimizer.step()`` stays local.

Signals, the exception hook and the exit belong to the whole process, and a process is in one
process group at a time: what is true of the process (which rank it is, whether it failed, was
interrupted or asked to stop, its heartbeat and hang watcher) is one record, ``Rank.process``,
shared by every :class:`Rank` of the process. The signal handlers (:mod:`minifabric.runtime.signals`)
reach both through one accessor, :func:`current`: the rank launched last in this process. Besides
:mod:`minifabric.process`, this is the one module of minifabric allowed module-level state
(``tests/unit/test_module_state.py``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from minifabric import collectives, process
from minifabric._torch import default_store, group_timeout
from minifabric.runtime import heartbeat, ray, signals
from minifabric.runtime.environment import destroy_process_group, exit_barrier_group, init_process_group
from minifabric.runtime.hang import HangWatch
from minifabric.runtime.rendezvous import store_host

#: environment variable: the collective timeout in seconds, where the strategy was not given one
TIMEOUT_VAR = "MINIFABRIC_TIMEOUT"
#: a process group holds its timeout in whole milliseconds (torch drops the rest): within one, the same
_GROUP_RESOLUTION = timedelta(milliseconds=1)


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


def check_adopted_timeout(timeout: timedelta, explicit: bool) -> None:
    """Refuse a timeout asked for (the strategy's ``timeout=``, else ``MINIFABRIC_TIMEOUT``) where the
    process group already exists (the script's own ``init_process_group``, Ray Train): its
    collectives keep the timeout they were created with, so the one asked for would be silently
    ignored. Every rank has both values: every rank raises."""
    if not explicit and not os.environ.get(TIMEOUT_VAR):
        return
    wanted = collective_timeout(timeout, explicit)
    adopted = group_timeout()
    if adopted is not None and abs(adopted - wanted) < _GROUP_RESOLUTION:
        return
    asked = f"the strategy was given timeout={wanted}" if explicit else f"{TIMEOUT_VAR} asks for timeout={wanted}"
    held = "a timeout this torch does not show" if adopted is None else f"timeout={adopted}"
    drop = "leave `timeout=` out of the strategy" if explicit else f"unset {TIMEOUT_VAR}"
    raise ValueError(
        f"{asked}, but the process group was created before the Accelerator, with {held}, which its"
        " collectives keep. Give the timeout where the group is created"
        f" (`dist.init_process_group(..., timeout=timedelta(seconds={wanted.total_seconds():g}))`, or the"
        f" engine's setting), or {drop}."
    )


class Rank:
    """Joining, stopping and leaving for one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.steps = 0
        self.world_size = 1
        self._stop_reads = 0  # how often this rank's loop read should_stop (the signal handlers ask)
        self._stop_group: dist.ProcessGroup | None = None
        self._preempted: Callable[[], bool] | None = None  # Ray Train's notice (decided at the first read)
        self._exit_group: dist.ProcessGroup | None = None
        self._committed: Path | None = None
        self._pending: Any = None  # the handle of an asynchronous save in flight

    @property
    def process(self) -> ProcessRecord:
        """What is true of this whole process (shared by every rank object of the process)."""
        return _process

    def prepare(self, rank: int, world_size: int) -> None:
        """Become this process's current rank and install its signal handling (Ctrl-C only with several processes).

        The preemption handlers (SIGTERM, SIGUSR1) are armed here, at launch: a signal is held for
        the next read of ``should_stop`` once the loop has read it at least once; before that it
        ends the process as it would without minifabric.
        """
        self.world_size = world_size
        _process.rank = self
        if world_size > 1:
            install_signals(rank)
            process.die_with_parent()
        else:
            signals.install_stop_signals(current)

    def join(self, environment: Any, backend: str, timeout: timedelta) -> None:
        """Join the default process group and create this rank's own small groups."""
        init_process_group(environment, backend, timeout)
        if _process.hook is not None:  # our hook labels the failing rank; exiting from it must stay possible
            process.set_excepthook(_process.hook)  # init_process_group wraps it in its own
        self.world_size = dist.get_world_size()
        if self.world_size > 1:
            self._stop_group = dist.new_group(backend="gloo", timeout=timeout)
            self._exit_group = exit_barrier_group()
            _process.watch(default_store(), dist.get_rank(), self.world_size, timeout.total_seconds())

    def leave(self) -> None:
        """Leave the process group together with the other ranks (bounded wait)."""
        _process.stop_watching()
        destroy_process_group(self._exit_group)

    # ---- the loop ----------------------------------------------------------------------------

    def step_done(self) -> None:
        """After every optimizer step: count it (local; for the Ctrl-C message)."""
        self.steps += 1

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank (one all-reduce on this rank's gloo group).

        Every rank must call it at the same point: in a process group this rank did not create
        (adopted: the script's own ``init_process_group``, Ray Train, a second Accelerator) the
        small gloo group is made at the first call, which every rank makes together, with the
        adopted group's timeout (not torch's default). Without a process group of several ranks it
        is ``flag``.
        """
        if self._stop_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._stop_group = dist.new_group(backend="gloo", timeout=group_timeout())
        return collectives.any_rank(flag, self._stop_group) if self._stop_group is not None else flag

    def holds_stop_signals(self) -> bool:
        """Whether a preemption signal only sets the flag ``should_stop`` reports (the loop has read it).

        A script that never asks keeps the default action of the signal (the process ends).
        """
        return self._stop_reads > 0

    def should_stop(self) -> bool:
        """Whether any rank received SIGTERM or SIGUSR1, or Ray Train reports a preemption.

        Every rank must call it at the same point of the loop: it is one all-reduce of a single
        integer on this rank's gloo group, and inside a Ray Train (v2) worker one call of
        ``ray.train.get_preemption_info()`` (Ray's own collective, the same answer on every worker).
        """
        if self._stop_reads == 0:
            self._preempted = ray.preemption_reader()
        self._stop_reads += 1
        # called on every read (never skipped by a signal already received): Ray counts the calls
        preempted = self._preempted is not None and self._preempted()
        return self.any_rank(stop_requested() or preempted)

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


class ProcessRecord:
    """What this process knows about itself, whichever rank object runs in it (one per process)."""

    def __init__(self) -> None:
        self.number: int | None = None  # the global rank, for messages (None: not known yet)
        self.failed = False
        self.interrupted = False
        self.stop_signal: int | None = None  # the preemption signal received, if any
        self.rank = Rank()  # the current rank: the one launched last (a bare one before any launch)
        self.hook: Callable | None = None  # the exception hook of minifabric.runtime.signals, once installed
        self.exit_lock = threading.Lock()  # the grace timer and the main thread may both end after Ctrl-C
        self.heartbeat: heartbeat.Heartbeat | None = None
        self.hang: HangWatch | None = None

    def ending_badly(self) -> bool:
        """Whether this process is ending with an error or an interrupt (set before exit handlers run)."""
        return self.failed or self.interrupted or getattr(sys, "last_value", None) is not None

    def end(self, code: int) -> NoReturn:
        """End this process now with ``code`` (non-zero: it failed): exit handlers run, the slow teardown does not."""
        self.failed = self.failed or code != 0
        process.end(code)

    def watch(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        """Start the hang watcher and the heartbeat of this process (once each)."""
        if self.hang is None:
            self.hang = HangWatch(store, rank, timeout_s, store_gone=self.store_gone)
            self.hang.start()
        if self.heartbeat is None:
            self.heartbeat = heartbeat.start(store, rank, world_size, store_host(), quiet=self.ending_badly)

    def stop_watching(self) -> None:
        """Stop the hang watcher and the heartbeat (before the process group goes away on a normal exit)."""
        hang, self.hang = self.hang, None
        if hang is not None:
            hang.stop()
        beat, self.heartbeat = self.heartbeat, None
        if beat is not None:
            beat.stop()

    def report(self, error: BaseException) -> bool:
        """Report an uncaught error first where it is a collective timeout (True if it was reported)."""
        return self.hang is not None and self.hang.report_timeout(error)

    def store_gone(self) -> bool:
        """Whether the heartbeat saw the run's store go (its host left or ended): calling it would only warn."""
        return self.heartbeat is not None and self.heartbeat.gone

    def post_fault(self, text: str) -> None:
        """Post this rank's one-line cause of failure for the other ranks (no-op without a heartbeat)."""
        if self.heartbeat is not None:
            self.heartbeat.post_fault(text)

    def culprit(self, wait: float = 0.0) -> str | None:
        """Which other rank ended the run, as far as this rank can tell within ``wait`` seconds (None if it cannot)."""
        return self.heartbeat.culprit_within(wait) if self.heartbeat is not None else None

    def let_local_peers_end(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the other ranks on this host have ended (with a heartbeat)."""
        if self.heartbeat is not None:
            self.heartbeat.let_local_peers_end(timeout)


_process = ProcessRecord()


def current() -> Rank:
    """This process's current rank: the one launched last (its ``process`` is the process's record)."""
    return _process.rank


def install_signals(number: int | None = None) -> None:
    """Install the signal handlers and the exception hook in this process; ``number``: its global rank, if known."""
    if number is not None:
        _process.number = number
    _process.hook = signals.install(current, _process.hook)


def end(code: int) -> NoReturn:
    """End this process now with ``code`` (non-zero: it failed): exit handlers run, the slow teardown does not."""
    _process.end(code)


def ending_badly() -> bool:
    """Whether this process is ending with an error or an interrupt (set before exit handlers run)."""
    return _process.ending_badly()


def stop_requested() -> bool:
    """Whether this process received a preemption signal (SIGTERM or SIGUSR1)."""
    return _process.stop_signal is not None
