"""Hang diagnostics: when a collective times out, every rank shows where it is, labelled with its rank.

A rank stuck outside any collective (an endless loop, a deadlock in user code) leaves the others
waiting in one. After the collective timeout (``Strategy(timeout=...)`` or ``MINIFABRIC_TIMEOUT``
seconds, default 30 minutes) the waiting rank's collective fails; its exception hook then prints
which collective it waited in, posts the report to the run's key-value store and prints its
stack. A thread in every other rank polls the store and, seeing the report, prints that rank's
Python stack and ends the process, so the job ends with a non-zero code and one stack per rank.

This works where a timed-out collective raises a Python exception (gloo). NCCL aborts the process
on its own watchdog's timeout instead; see ``TORCH_NCCL_DUMP_ON_TIMEOUT`` there.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from minifabric import process
from minifabric.runtime.signals import format_stack

_KEY = "minifabric/hang"
_POLL_SECONDS = 0.5
#: seconds the rank that timed out waits for the others to print their stacks before it exits
_REPORT_GRACE_SECONDS = 2.0
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


class HangWatch:
    """Watches the run's store for another rank's timeout report, and reports this rank's own (one per process).

    Args:
        store: the run's key-value store.
        rank: this rank.
        timeout_s: the collective timeout in seconds (named in the report).
        store_gone: whether the store's host left or ended (then a call would only print torch's warning).
    """

    def __init__(self, store: Any, rank: int, timeout_s: float, store_gone: Callable[[], bool]) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.store_gone = store_gone
        self.stopped = threading.Event()
        self.main = threading.main_thread()

    def start(self) -> None:
        """Start polling the store in a daemon thread."""
        threading.Thread(target=self._poll, name="minifabric-hang-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop watching (before the process group goes away)."""
        self.stopped.set()

    def _poll(self) -> None:
        while not self.stopped.wait(_POLL_SECONDS):
            if self.store_gone():
                return
            try:
                if not self.store.check([_KEY]):
                    continue
                report = self.store.get(_KEY).decode()
            except Exception:  # the store is gone: the run is ending
                return
            if self.stopped.is_set():
                return
            frame = sys._current_frames().get(self.main.ident or 0)
            stack = format_stack(traceback.extract_stack(frame)) if frame is not None else "  (no frame)\n"
            process.write_stderr(f"[minifabric] rank {self.rank} was here when {report}:\n{_label(stack, self.rank)}")
            process.hard_exit(1)

    def report_timeout(self, error: BaseException) -> bool:
        """If ``error`` is a collective timeout: report it to every rank, print this stack; True if so."""
        if not is_timeout(error):
            return False
        op = _collective_name(error.__traceback__)
        report = f"rank {self.rank} waited {self.timeout_s:g}s in {op}"
        process.write_stderr(
            f"[minifabric] rank {self.rank} waited {self.timeout_s:g}s in {op} (the collective timeout) for a"
            " rank that never joined it. Every rank's stack follows: look for the one outside any collective."
            " Raise the limit with Strategy(timeout=...) or MINIFABRIC_TIMEOUT=SECONDS if the wait was legitimate.\n"
            f"[minifabric] rank {self.rank} was here when {report}:\n"
            f"{_label(format_stack(traceback.extract_tb(error.__traceback__)), self.rank)}"
            f"[rank {self.rank}] {type(error).__name__}: {error}\n"
        )
        self.stopped.set()
        try:
            self.store.set(_KEY, report)
        except Exception:
            return True
        time.sleep(_REPORT_GRACE_SECONDS)  # let the others print their stacks before this rank ends the run
        return True


def _label(stack: str, rank: int) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in stack.rstrip("\n").split("\n"))


def _collective_name(tb: TracebackType | None) -> str:
    """The torch.distributed call the traceback ended in (the innermost public one)."""
    name = "a collective"
    for frame, _ in traceback.walk_tb(tb):
        code = frame.f_code
        if (
            code.co_filename.endswith(_C10D_FILE)
            and not code.co_name.startswith("_")
            and code.co_name != "wrapper"
        ):
            name = code.co_name
    return name


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that gave up waiting."""
    return isinstance(error, RuntimeError) and "timed out" in str(error).lower()
