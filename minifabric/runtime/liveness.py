"""What the heartbeat can learn about a process without its help: the kernel's view, and a store call with a deadline.

- :func:`pid_ended`: whether a process of this host has ended, and how (its wait status, read while
  it is a zombie).
- :func:`progress`: a live process's scheduler state and the CPU time all its threads have used:
  ``T``/``t`` is a stopped process (SIGSTOP, a debugger); CPU time that keeps advancing is a process
  at work, even one whose Python threads cannot run because one long C call holds the GIL.
- :class:`BoundedStore`: the calls of a key-value store made in one daemon thread, each waited for
  at most a given time. A ``TCPStore`` call has no deadline of its own: against a server whose
  process is stopped it waits forever (the connection stays open and the kernel accepts the
  request), whatever timeout the store was given.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

#: fields of /proc/PID/stat after the command name, up to and including exit_code (Linux >= 3.5)
_STAT_FIELDS_AFTER_NAME = 50
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_ended(pid: int) -> tuple[bool, str | None]:
    """Whether process ``pid`` of this host has ended, and how, while the kernel still tells.

    Until its parent (a launcher, torchrun's agent) reaps it, an ended process is a zombie whose
    ``/proc/PID/stat`` holds its wait status (the last field, Linux >= 3.5): "was killed by SIGSEGV",
    "exited with code 3". Once reaped it is gone and only "ended" is known (how: None).
    """
    fields = _stat(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True, None
        except PermissionError:
            return False, None
        return False, None
    if fields[0] not in ("Z", "X"):
        return False, None
    return True, describe_status(int(fields[-1])) if len(fields) == _STAT_FIELDS_AFTER_NAME else None


def describe_status(status: int) -> str | None:
    """A wait status as words; None for 0 (a clean exit, or a status the kernel did not show us)."""
    if status & 0x7F:
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        return f"was killed by {name}"
    code = (status >> 8) & 0xFF
    return f"exited with code {code}" if code else None


def progress(pid: int) -> tuple[str, float] | None:
    """``(state, cpu_seconds)`` of live process ``pid`` of this host: its scheduler state and its threads' CPU time.

    None when the kernel does not tell (no such process, no ``/proc``).
    """
    fields = _stat(pid)
    if fields is None or len(fields) < 13:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND


def is_stopped(state: str) -> bool:
    """Whether a ``/proc`` state letter is a stopped process (SIGSTOP, SIGTSTP, or a debugger's stop)."""
    return state in ("T", "t")


def own_connection(store: Any) -> Any:
    """A new connection to ``store``'s server (``store`` itself for a store type that cannot make one).

    The heartbeat's calls then never queue behind the process group's on the shared connection.
    """
    try:
        return store.clone()
    except (RuntimeError, AttributeError):  # a store type without clone (FileStore, HashStore)
        return store


class StoreSilent(Exception):
    """A store call got no answer within its deadline (the process that hosts the store may be stopped)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer for {seconds:.0f}s")
        self.seconds = seconds


class BoundedStore:
    """Calls ``store`` from one daemon thread; each caller waits at most ``within`` seconds for the answer.

    A call that gets no answer in time raises :class:`StoreSilent` (it stays in flight: the calls
    after it wait behind it). An error of the store (its server is gone) is raised as it is.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, within: float, method: str, *args: Any) -> Any:
        """``store.method(*args)``, waited for at most ``within`` seconds."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="minifabric-store-calls", daemon=True)
                self._thread.start()
        done = threading.Event()
        answer: list[Any] = []
        self._jobs.put((getattr(self.store, method), args, answer, done))
        started = time.monotonic()
        if not done.wait(within):
            raise StoreSilent(time.monotonic() - started)
        ok, value = answer[0]
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            function, args, answer, done = self._jobs.get()
            answer.append(_attempt(function, args))
            done.set()


def _attempt(function: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
    try:
        return True, function(*args)
    except Exception as error:  # handed to the caller
        return False, error
