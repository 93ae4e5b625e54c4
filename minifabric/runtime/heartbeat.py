"""Heartbeat: notice a rank that stopped or hangs, and name the rank that failed, on a side channel.

A rank can stop without ending (SIGSTOP, a debugger, a frozen host, a C call that never returns
while holding the GIL); its peers would wait in their next collective until the collective timeout
(30 minutes by default), and nothing would say which rank it was. A rank that ends without a report
(SIGKILL, SIGSEGV) leaves its peers with "connection closed by peer". So every rank of a run with
several processes starts a daemon thread when it joins that, through the run's key-value store (on
a connection of its own: a side channel, not a collective),

- **beats**: increments this rank's counter every ``interval`` seconds (a tenth of the timeout, at
  most one second). A Python thread: while one long C call holds the GIL, it cannot beat;
- **vouches**: a peer on this host whose counter stands still while its process keeps using CPU
  (at least :data:`BUSY_SHARE` of the time, read from ``/proc``) is at work in such a call: this
  rank beats for it, so no rank, on any host, takes it for silent;
- **watches**: a peer whose counter has not moved for :func:`heartbeat_timeout` seconds
  (``MINIFABRIC_HEARTBEAT_TIMEOUT``, default 60; 0: off) is silent: this rank prints which rank
  (host, pid) and why (stopped: ``/proc`` state ``T``; hung: no CPU used; on another host: not
  known), then kills it if it runs on this host, and ends with code 1. A peer on this host that
  ends is named at once, with its signal: a second thread sleeps on a pidfd per peer of this host
  and reads its exit status from ``/proc`` before its parent (a launcher, torchrun's agent)
  collects it, and posts it for the other ranks;
- **listens**: a rank that fails with a report (an uncaught exception, Ctrl-C, a preemption signal
  that ends it) posts one line (the first post wins); every other rank prints it and ends with code 1.

Every store call waits at most the heartbeat timeout (2 s for a failing rank's post): rank 0 hosts
the store under ``acc.launch()``, srun and pod operators, and a store that does not answer is a
silent rank 0, judged as above. Once the rank that hosts the store has left or ended, no rank calls
the store again (torch would print a warning with a C++ stack for every call).
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
from minifabric.runtime.liveness import (
    BoundedStore,
    StoreSilent,
    is_stopped,
    own_connection,
    pid_ended,
    progress,
)

#: environment variable: seconds without a heartbeat before a rank is declared silent (0: off)
HEARTBEAT_VAR = "MINIFABRIC_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_SECONDS = 60.0
#: share of the wall time a peer's threads must spend on a CPU to count as at work (not hung)
BUSY_SHARE = 0.05
#: the longest a failing rank waits for the store to take its one-line cause
_POST_SECONDS = 2.0
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


class _Gone(Exception):
    """The store is gone (the process that hosted it left or ended): no more calls."""


class Heartbeat:
    """The heartbeat thread of one rank (see the module docstring).

    Args:
        store: the run's key-value store.
        rank: this rank.
        world_size: the number of ranks.
        timeout: the heartbeat timeout in seconds.
        store_host: the rank whose process hosts the store (None: another process, e.g. torchrun's agent).
        quiet: while it returns True, this rank is ending itself and says why: silent peers are not reported.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        store_host: int | None = 0,
        quiet: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rank, self.world_size, self.timeout, self.store_host = rank, world_size, timeout, store_host
        self.quiet = quiet
        self.store = BoundedStore(store)
        self.interval = min(1.0, timeout / 10)
        #: a stalled peer of this host at work is beaten for after this long (well inside the timeout)
        self.vouch_after = min(timeout / 2, max(1.0, 3 * self.interval))
        self.peers: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as each peer posted it
        self.stopped = threading.Event()
        self.gone = False  # the store is gone, or its host left: never call it again
        self._dead: str | None = None  # what this rank saw of a peer that ended without a report
        self._stalled: dict[int, tuple[float, float]] = {}  # peer -> (time, its CPU seconds) when it stalled
        self._looked = time.monotonic()  # when this rank last read its peers' counters

    def _call(self, method: str, *args: Any, within: float | None = None) -> Any:
        """A store call, waited for at most ``within`` seconds (the timeout); :class:`_Gone` once the store is."""
        if self.gone or self._store_host_ended():
            raise _Gone
        try:
            return self.store.call(self.timeout if within is None else within, method, *args)
        except StoreSilent:
            raise
        except Exception:  # the connection broke: the store's process ended
            self.gone = True
            raise _Gone from None

    def _store_host_ended(self) -> bool:
        """Whether the rank that hosts the store runs on this host and has ended (then the store is gone)."""
        host, pid = self.peers.get(self.store_host, ("?", 0)) if self.store_host != self.rank else ("?", 0)
        if pid and host == HOST and pid_ended(pid)[0]:
            self.gone = True
        return self.gone

    def start(self) -> None:
        """Post who this rank is and start beating and watching."""
        self._call("set", f"{_PREFIX}/id/{self.rank}", f"{HOST} {os.getpid()}")
        threading.Thread(target=self._run, name="minifabric-heartbeat", daemon=True).start()
        if hasattr(os, "pidfd_open"):  # Linux >= 5.3: be woken the moment a peer on this host ends
            threading.Thread(target=self._watch_exits, name="minifabric-exit-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop, and tell the peers that this rank left on purpose (it is not silent)."""
        self.stopped.set()
        try:
            self._call("set", f"{_PREFIX}/left/{self.rank}", "1", within=_POST_SECONDS)
        except Exception:  # the store is gone or silent: the run is ending anyway
            pass

    def describe(self, rank: int) -> str:
        """``"rank R (host H, pid P)"`` with what this rank knows of ``rank``."""
        host, pid = self.peers.get(rank, ("?", 0))
        return f"rank {rank} (host {host}, pid {pid})" if pid else f"rank {rank}"

    def post_fault(self, text: str) -> None:
        """Post this rank's one-line cause for the others (the first post of the run wins)."""
        try:
            self._call("compare_set", _FAULT_KEY, "", f"{self.rank}\n{text}", within=_POST_SECONDS)
        except Exception:
            pass

    def posted_fault(self) -> str | None:
        """The cause another rank posted, if any."""
        try:
            if not self._call("check", [_FAULT_KEY], within=_POST_SECONDS):
                return None
            rank, text = self._call("get", _FAULT_KEY, within=_POST_SECONDS).decode().split("\n", 1)
        except Exception:
            return None
        return None if int(rank) == self.rank else text

    def dead_peer(self) -> tuple[int, str | None] | None:
        """A peer on this host whose process has ended without leaving, and how if still known.

        One killed by a signal comes first: a peer that exited with a code may have ended because
        of it. The rank that hosts the store cannot be asked whether it left (its store went with
        it): it counts only when its exit status is known and not a clean exit.
        """
        dead = []
        for rank, (host, pid) in sorted(self.peers.items()):
            if rank == self.rank or host != HOST:
                continue
            ended, how = pid_ended(pid)
            if not ended:
                continue
            if how is not None if rank == self.store_host else not self._left(rank, unknown=False):
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
            if rank == self.store_host:
                self.gone = True  # its store went with it: nobody to tell
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
                except StoreSilent:  # the heartbeat thread judges a silent store
                    continue
                except _Gone:  # the run is ending
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
                ended, how = pid_ended(self.peers[rank][1])
                os.close(fd)
                if not ended or self.stopped.is_set():
                    continue
                if rank == self.store_host:
                    # its store is gone: it cannot tell whether the rank left; its exit status can
                    self.gone = True
                    if how is not None:
                        self._saw_dead(rank, how)
                elif not self._left(rank, unknown=True):
                    self._saw_dead(rank, how)

    def _left(self, rank: int, unknown: bool = True) -> bool:
        """Whether ``rank`` left on purpose; ``unknown`` when the store cannot tell (it is gone or silent)."""
        try:
            return bool(self._call("check", [f"{_PREFIX}/left/{rank}"], within=_POST_SECONDS))
        except Exception:
            return unknown

    def _learn_peers(self) -> None:
        for rank in range(self.world_size):
            if rank not in self.peers and self._call("check", [f"{_PREFIX}/id/{rank}"]):
                host, pid = self._call("get", f"{_PREFIX}/id/{rank}").decode().split()
                self.peers[rank] = (host, int(pid))

    def _run(self) -> None:
        counters = {rank: -1 for rank in range(self.world_size) if rank != self.rank}
        changed = dict.fromkeys(counters, time.monotonic())
        while not self.stopped.wait(self.interval):
            culprit = self.culprit()
            if culprit is not None and not self.stopped.is_set():
                self._end(culprit)
            if self.gone:
                return  # the store's host left or ended: the launcher or the collectives end the run
            try:
                self._round(counters, changed)
            except StoreSilent as silent:
                self._store_silent(silent.seconds)
            except _Gone:
                continue  # once more: the exit watch may name the rank that took the store with it

    def _round(self, counters: dict[int, int], changed: dict[int, float]) -> None:
        if time.monotonic() - self._looked > self.vouch_after:
            # this rank could not look (its own GIL was held): what its peers did meanwhile is unknown
            changed.update(dict.fromkeys(changed, time.monotonic()))
            self._stalled.clear()
        self._call("add", f"{_PREFIX}/beat/{self.rank}", 1)
        if len(self.peers) < self.world_size:
            self._learn_peers()
        host = self.store_host
        if host is not None and host != self.rank and self._call("check", [f"{_PREFIX}/left/{host}"]):
            self.gone = True  # it is leaving, and its store with it: stop calling it
            return
        for rank in counters:
            count = self._call("add", f"{_PREFIX}/beat/{rank}", 0)
            now = time.monotonic()
            if count != counters[rank]:
                counters[rank], changed[rank] = count, now
                self._stalled.pop(rank, None)
                continue
            busy = self._busy(rank)  # the first look at a stalled peer only takes its CPU time
            if now - changed[rank] < self.vouch_after or self.stopped.is_set():
                continue
            if busy:
                self._call("add", f"{_PREFIX}/beat/{rank}", 1)  # it is at work: beat for it
            elif now - changed[rank] > self.timeout and not self._left(rank):
                self._silent(rank, now - changed[rank])
        self._looked = time.monotonic()

    def _busy(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host and used CPU for at least BUSY_SHARE of the time since it was first seen stalled."""
        host, pid = self.peers.get(rank, ("?", 0))
        seen = progress(pid) if pid and host == HOST else None
        if seen is None or is_stopped(seen[0]):
            self._stalled.pop(rank, None)
            return False
        now = time.monotonic()
        since, cpu = self._stalled.setdefault(rank, (now, seen[1]))
        return now > since and seen[1] - cpu >= BUSY_SHARE * (now - since)

    def _verdict(self, rank: int, no_beat: str) -> tuple[str, int]:
        """Why ``rank`` is silent, in words, and its pid if this rank kills it (0: it runs on another host)."""
        host, pid = self.peers.get(rank, ("?", 0))
        seen = progress(pid) if pid and host == HOST else None
        setting = f"({HEARTBEAT_VAR}={self.timeout:g})"
        if seen is not None and is_stopped(seen[0]):
            return f"{self.describe(rank)} is stopped (SIGSTOP or a debugger): {no_beat}; killing it {setting}", pid
        if seen is not None:
            why = "hung (e.g. in a C call that holds the GIL and waits)"
            return f"{self.describe(rank)} {no_beat} and used no CPU: {why}; killing it {setting}", pid
        why = "stopped, hung, or at work in a C call that holds the GIL (no rank on its host could look)"
        return f"{self.describe(rank)} {no_beat}: {why} {setting}", 0

    def _silent(self, rank: int, seconds: float) -> None:
        self._end(*self._verdict(rank, f"sent no heartbeat for {seconds:.0f}s"))

    def _store_silent(self, seconds: float) -> None:
        """The store did not answer within the timeout: judge the rank that hosts it (it may be only at work)."""
        host = self.store_host
        no_answer = f"the run's store, which it hosts, did not answer for {seconds:.0f}s"
        if host is None:
            text, pid = f"the run's store (hosted by torchrun's agent) did not answer for {seconds:.0f}s", 0
            text += f" ({HEARTBEAT_VAR}={self.timeout:g})"
        else:
            self._stalled.pop(host, None)
            self._busy(host)  # takes its CPU time now ...
            time.sleep(max(self.interval, 0.5))  # ... and again after this long: at work, or hung
            if self._busy(host):
                return  # at work: its store is only slow; the call in flight goes on waiting
            text, pid = self._verdict(host, no_answer)
        self.gone = True  # nothing more to post or read: the others see the same silence
        self._end(text, pid)

    def _end(self, cause: str, kill: int = 0) -> None:
        """Print why, kill the silent peer ``kill`` if given (after saying so), post the cause, end this rank."""
        if self.quiet():
            return  # this rank is ending itself and says why (the launcher ends the rest)
        if kill:
            self._dead = cause  # a collective that fails as the peer dies names the same cause
        process.write_stderr(f"[minifabric] {HOST}: rank {self.rank} stopped: {cause}\n")
        if kill:
            try:
                os.kill(kill, signal.SIGKILL)  # it cannot end itself: stopped, or stuck
            except OSError:
                pass
        self.post_fault(cause)
        process.hard_exit(1)


    def culprit_within(self, wait: float) -> str | None:
        """Which other rank ended the run, as far as this rank can tell within ``wait`` seconds (None if it cannot).

        A connection to a rank closes while the kernel is still taking that process down, a moment
        before it shows as ended: ``wait`` covers that moment.
        """
        deadline = time.monotonic() + wait
        while not self.stopped.is_set():
            found = self.culprit()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.01)  # often enough to read a dead peer's status before its parent reaps it
        return None

    def let_local_peers_end(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the other ranks on this host have ended.

        Rank 0 of a local launch holds the run's store: a rank still posting to it when rank 0 exits
        gets torch's connection-reset warning, with a C++ stack, on its stderr. Ranks on other hosts
        are not waited for.
        """
        pids = [pid for host, pid in self.peers.values() if host == HOST and pid != os.getpid()]
        deadline = time.monotonic() + timeout
        while any(not pid_ended(pid)[0] for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)


def start(
    store: Any, rank: int, world_size: int, store_host: int | None, quiet: Callable[[], bool]
) -> Heartbeat | None:
    """Start a rank's heartbeat, on a connection of its own to ``store`` (None when ``MINIFABRIC_HEARTBEAT_TIMEOUT=0``).

    ``store_host`` is the rank whose process hosts ``store`` (None: another process, e.g. torchrun's agent).
    """
    timeout = heartbeat_timeout()
    if timeout <= 0 or world_size <= 1:
        return None
    beat = Heartbeat(own_connection(store), rank, world_size, timeout, store_host, quiet=quiet)
    beat.start()
    return beat
