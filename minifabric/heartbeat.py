"""Heartbeat: notice a rank that stopped or hangs, and name the rank that failed, on a side channel.

A rank can stop without ending: SIGSTOP, or a C call that never returns while holding the GIL
(every Python thread of that process stops with it). Its peers then wait in their next collective
until the collective timeout (30 minutes by default), and nothing says which rank it was. And a
rank that ends without a report (SIGKILL, SIGSEGV, SIGABRT) leaves its peers with "connection
closed by peer".

So every rank of a run with several processes starts one daemon thread when it joins. Through the
run's key-value store (the TCPStore of the default process group: a side channel, not a
collective), the thread

- **beats**: increments this rank's counter every ``interval`` seconds (a tenth of the timeout, at
  most one second). A Python thread, on purpose: a rank that holds the GIL forever stops beating;
- **watches**: a peer whose counter has not moved for :func:`heartbeat_timeout` seconds
  (``MINIFABRIC_HEARTBEAT_TIMEOUT``, default 60; 0 turns the heartbeat off) is silent: this rank
  prints which rank (host, pid) and why, kills it if it runs on this host, and ends with code 1.
  A peer on this host whose process is gone (killed by a signal) is named the same way at once,
  with its signal: a second thread sleeps on a pidfd per peer of this host and, the moment one
  ends, reads its exit status from ``/proc`` before its parent (a launcher, torchrun's agent)
  collects it, and posts it for the other ranks;
- **listens**: a rank that fails with a report (an uncaught exception, also in a background
  thread, Ctrl-C, a preemption signal that ends it) posts one line under one key before it ends
  (the first post wins); every other rank prints that line as the cause and ends with code 1.

The heartbeat timeout is separate from the collective timeout: it bounds how long a silent rank
goes unnoticed, the collective timeout how long a legitimate collective may wait.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from minifabric import process

#: environment variable: seconds without a heartbeat before a rank is declared silent (0: off)
HEARTBEAT_VAR = "MINIFABRIC_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_SECONDS = 60.0
_PREFIX = "minifabric/heartbeat"
_FAULT_KEY = f"{_PREFIX}/fault"

HOST = socket.gethostname()


def heartbeat_timeout() -> float:
    """Seconds without a heartbeat before a peer is declared silent (``MINIFABRIC_HEARTBEAT_TIMEOUT``; 0: off)."""
    value = os.environ.get(HEARTBEAT_VAR)
    if not value:
        return DEFAULT_HEARTBEAT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"{HEARTBEAT_VAR}={value!r} is not a number of seconds; e.g. {HEARTBEAT_VAR}=60 (0 turns it off)"
        ) from None
    if seconds < 0:
        raise ValueError(f"{HEARTBEAT_VAR}={value!r} must be >= 0; e.g. {HEARTBEAT_VAR}=60 (0 turns it off)")
    return seconds


def _pid_ended(pid: int) -> tuple[bool, str | None]:
    """Whether process ``pid`` of this host has ended, and how, while the kernel still tells.

    Until its parent (a launcher, torchrun's agent) reaps it, an ended process is a zombie whose
    ``/proc/PID/stat`` holds its wait status (the last field, Linux >= 3.5): "was killed by SIGSEGV",
    "exited with code 3". Once reaped it is gone and only "ended" is known (how: None).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True, None
        except PermissionError:
            return False, None
        return False, None
    if fields[0] not in ("Z", "X"):
        return False, None
    return True, _describe_status(int(fields[-1])) if len(fields) == _STAT_FIELDS_AFTER_NAME else None


#: fields of /proc/PID/stat after the command name, up to and including exit_code (Linux >= 3.5)
_STAT_FIELDS_AFTER_NAME = 50


def _describe_status(status: int) -> str | None:
    """A wait status as words; None for 0 (a clean exit, or a status the kernel did not show us)."""
    if status & 0x7F:
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        return f"was killed by {name}"
    code = (status >> 8) & 0xFF
    return f"exited with code {code}" if code else None


class Heartbeat:
    """The heartbeat thread of one rank (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.interval = min(1.0, timeout / 10)
        self.peers: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as each peer posted it
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: str | None = None  # what this rank saw of a peer that ended without a report

    def start(self) -> None:
        """Post who this rank is and start beating and watching."""
        self.store.set(f"{_PREFIX}/id/{self.rank}", f"{HOST} {os.getpid()}")
        self._thread = threading.Thread(target=self._run, name="minifabric-heartbeat", daemon=True)
        self._thread.start()
        if hasattr(os, "pidfd_open"):  # Linux >= 5.3: be woken the moment a peer on this host ends
            threading.Thread(target=self._watch_exits, name="minifabric-exit-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop, and tell the peers that this rank left on purpose (it is not silent)."""
        self.stopped.set()
        try:
            self.store.set(f"{_PREFIX}/left/{self.rank}", "1")
        except Exception:  # the store is gone: the run is ending anyway
            pass

    def describe(self, rank: int) -> str:
        """``"rank R (host H, pid P)"`` with what this rank knows of ``rank``."""
        host, pid = self.peers.get(rank, ("?", 0))
        return f"rank {rank} (host {host}, pid {pid})" if pid else f"rank {rank}"

    def post_fault(self, text: str) -> None:
        """Post this rank's one-line cause for the others (the first post of the run wins)."""
        try:
            self.store.compare_set(_FAULT_KEY, "", f"{self.rank}\n{text}")
        except Exception:
            pass

    def posted_fault(self) -> str | None:
        """The cause another rank posted, if any."""
        try:
            if not self.store.check([_FAULT_KEY]):
                return None
            rank, text = self.store.get(_FAULT_KEY).decode().split("\n", 1)
        except Exception:
            return None
        return None if int(rank) == self.rank else text

    def dead_peer(self) -> tuple[int, str | None] | None:
        """A peer on this host whose process has ended without leaving, and how if still known.

        One killed by a signal comes first: a peer that exited with a code may have ended because
        of it.
        """
        dead = []
        for rank, (host, pid) in sorted(self.peers.items()):
            if rank == self.rank or host != HOST:
                continue
            ended, how = _pid_ended(pid)
            if ended and not self._left(rank, unknown=False):
                dead.append((rank, how))
        dead.sort(key=lambda found: not (found[1] or "").startswith("was killed"))
        return dead[0] if dead else None

    def culprit(self) -> str | None:
        """What this rank knows about which rank ended the run: a posted cause, or a dead peer.

        A dead peer, with its signal or exit code read while it is a zombie, is posted for the ranks
        that look later (after its parent reaped it, or on other hosts).
        """
        posted = self.posted_fault()
        if posted is not None:
            return posted
        if self._dead is None:
            dead = self.dead_peer()
            if dead is None:
                return None
            self._saw_dead(*dead)
        return self._dead

    def _saw_dead(self, rank: int, how: str | None) -> None:
        if self._dead is None:
            self._dead = f"{self.describe(rank)} {how or 'ended without a report (killed by a signal?)'}"
            self.post_fault(self._dead)  # the first rank that sees it tells the others (first post wins)

    def _watch_exits(self) -> None:
        """Wait on a pidfd per peer of this host; when one ends, read how before its parent reaps it.

        A launcher collects an ended rank within its polling interval (torchrun: 0.1 s), and then
        its signal is lost; this thread sleeps in ``poll`` and reads it at once.
        """
        poller = select.poll()
        watched: dict[int, int] = {}  # pidfd -> rank
        seen: set[int] = {self.rank}  # ranks watched or done
        while not self.stopped.is_set():
            learning = len(self.peers) < self.world_size
            if learning:
                try:
                    self._learn_peers()
                except Exception:  # the store is gone: the run is ending
                    return
            for rank, (host, pid) in list(self.peers.items()):
                if rank in seen or host != HOST:
                    continue
                seen.add(rank)
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # gone already: the heartbeat's own scan names it
                    continue
                watched[fd] = rank
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(50 if learning else 1000):
                rank = watched.pop(fd)
                poller.unregister(fd)
                ended, how = _pid_ended(self.peers[rank][1])
                os.close(fd)
                # a store that cannot tell (it lived in the rank that ended) blames nobody
                if ended and not self.stopped.is_set() and not self._left(rank, unknown=True):
                    self._saw_dead(rank, how)

    def _left(self, rank: int, unknown: bool = True) -> bool:
        """Whether ``rank`` left on purpose; ``unknown`` when the store cannot tell (it lived in a rank that ended)."""
        try:
            return bool(self.store.check([f"{_PREFIX}/left/{rank}"]))
        except Exception:
            return unknown

    def _learn_peers(self) -> None:
        for rank in range(self.world_size):
            if rank not in self.peers and self.store.check([f"{_PREFIX}/id/{rank}"]):
                host, pid = self.store.get(f"{_PREFIX}/id/{rank}").decode().split()
                self.peers[rank] = (host, int(pid))

    def _run(self) -> None:
        counters = {rank: -1 for rank in range(self.world_size) if rank != self.rank}
        changed = dict.fromkeys(counters, time.monotonic())
        try:
            while not self.stopped.wait(self.interval):
                self.store.add(f"{_PREFIX}/beat/{self.rank}", 1)
                if len(self.peers) < self.world_size:
                    self._learn_peers()
                now = time.monotonic()
                culprit = self.culprit()
                if culprit is not None and not self.stopped.is_set():
                    self._end(culprit)
                for rank in counters:
                    count = self.store.add(f"{_PREFIX}/beat/{rank}", 0)
                    if count != counters[rank]:
                        counters[rank], changed[rank] = count, now
                    elif now - changed[rank] > self.timeout and not self._left(rank):
                        if not self.stopped.is_set():
                            self._silent(rank, now - changed[rank])
        except Exception:  # the store is gone (rank 0's process ended): the launcher ends the run
            return

    def _silent(self, rank: int, seconds: float) -> None:
        host, pid = self.peers.get(rank, ("?", 0))
        killed = ""
        if pid and host == HOST:
            try:
                os.kill(pid, signal.SIGKILL)  # it cannot end itself: stopped, or stuck holding the GIL
                killed = "; killed it"
            except OSError:
                pass
        text = (
            f"{self.describe(rank)} sent no heartbeat for {seconds:.0f}s: stopped (SIGSTOP) or hung in a"
            f" call that holds the GIL{killed} ({HEARTBEAT_VAR}={self.timeout:g})"
        )
        self.post_fault(text)
        self._end(text)

    def _end(self, cause: str) -> None:
        if any(condition() for condition in _quiet):
            return  # this rank is ending itself and says why
        process.write_stderr(f"[minifabric] {HOST}: rank {self.rank} stopped: {cause}\n")
        process.hard_exit(1)


_heartbeat: Heartbeat | None = None
_quiet: list[Callable[[], bool]] = []


def quiet_while(condition: Callable[[], bool]) -> None:
    """Do not report peers while ``condition()`` holds (this rank is ending itself: an error, Ctrl-C)."""
    _quiet[:] = [condition]


def start(store: Any, rank: int, world_size: int) -> Heartbeat | None:
    """Start this process's heartbeat (once; not when ``MINIFABRIC_HEARTBEAT_TIMEOUT=0``)."""
    global _heartbeat
    timeout = heartbeat_timeout()
    if _heartbeat is None and timeout > 0 and world_size > 1:
        _heartbeat = Heartbeat(store, rank, world_size, timeout)
        _heartbeat.start()
    return _heartbeat


def stop() -> None:
    """Stop the heartbeat (before the process group goes away on a normal exit)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def post_fault(text: str) -> None:
    """Post this rank's one-line cause of failure for the other ranks (no-op without a heartbeat)."""
    if _heartbeat is not None:
        _heartbeat.post_fault(text)


def let_local_peers_end(timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, until the other ranks on this host have ended.

    Rank 0 of a local launch holds the run's store: a rank still posting to it when rank 0 exits
    gets torch's connection-reset warning, with a C++ stack, on its stderr. Ranks on other hosts
    are not waited for.
    """
    if _heartbeat is None:
        return
    pids = [pid for host, pid in _heartbeat.peers.values() if host == HOST and pid != os.getpid()]
    deadline = time.monotonic() + timeout
    while any(not _pid_ended(pid)[0] for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def culprit(wait: float = 0.0) -> str | None:
    """Which other rank ended the run, as far as this rank can tell within ``wait`` seconds (None if it cannot).

    A connection to a rank closes while the kernel is still taking that process down, a moment
    before it shows as ended: ``wait`` covers that moment.
    """
    deadline = time.monotonic() + wait
    while _heartbeat is not None:
        found = _heartbeat.culprit()
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)  # often enough to read a dead peer's status before its parent reaps it
    return None
