"""How a rank reacts to signals and to its own end: Ctrl-C, preemption, uncaught exceptions.

Signals belong to the whole process. This module holds the handlers only, and installs them once,
only where the user has not installed their own; what they read and set (which rank this is,
whether it was interrupted or asked to stop, the heartbeat) is the process's record in
:mod:`minifabric.runtime.rank`, reached through the one accessor passed to :func:`install`.

- **Ctrl-C** (SIGINT): the rank unwinds with ``KeyboardInterrupt`` and exits with code 130 after at
  most :data:`INTERRUPT_GRACE_SECONDS`; global rank 0 prints one line (``interrupted at step N;
  last committed checkpoint: PATH``), the other ranks print nothing. A second Ctrl-C is ignored.
- **Preemption** (SIGTERM, SIGUSR1): the handlers are installed when the ranks join (``launch``).
  Once the training loop has read ``acc.should_stop``, the signal only sets a flag that every rank
  sees at the next read of ``should_stop`` (the read is the agreement), so the loop saves and exits
  on every rank at the same step. Before that (a script that never asks), the signal ends the
  process as it would without minifabric. A second signal always ends it.
- **Uncaught exceptions** (also in a thread the user started): ``[minifabric] HOST: rank R failed
  with ...`` and the traceback, once, and the cause is posted for the other ranks
  (:mod:`minifabric.runtime.heartbeat`); a rank that only lost the connection to a rank that failed first
  prints one line naming that rank instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from functools import partial
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from minifabric import process
from minifabric.errors import PeerFailed
from minifabric.process import write_stderr
from minifabric.runtime.heartbeat import HOST

if TYPE_CHECKING:
    from minifabric.runtime.rank import Rank

#: seconds a rank may take to unwind after Ctrl-C before it is ended
INTERRUPT_GRACE_SECONDS = 3.0
#: exit code after Ctrl-C (128 + SIGINT), as a shell reports it
INTERRUPTED_EXIT_CODE = 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# gloo and nccl phrases for "the other side of this collective went away"
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)
_HIDDEN_FRAMES = ("runpy.py", "<frozen runpy>", os.path.join("minifabric", "runtime", "run_script.py"))

#: the accessor the handlers reach this process's rank through (:func:`minifabric.runtime.rank.current`)
Current = Callable[[], "Rank"]


def install(current: Current, hook: Callable | None = None) -> Callable:
    """Install the handlers in this process (signal handlers only from the main thread, and only once).

    Args:
        current: returns this process's :class:`~minifabric.runtime.rank.Rank`, which every handler reads.
        hook: this module's exception hook made by an earlier call (None: make it, around ``sys.excepthook``).

    Returns:
        The exception hook, to pass again (and to put back in front after torch wraps it).
    """
    if hook is None:
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            _excepthook(current, previous, tp, value, tb)

    process.set_excepthook(hook)
    process.set_thread_excepthook(partial(_thread_excepthook, current))
    if process.in_main_thread():
        if process.signal_handler(signal.SIGINT) is signal.default_int_handler:
            process.set_signal_handler(signal.SIGINT, partial(_on_interrupt, current))
    install_stop_signals(current)
    return hook


def install_stop_signals(current: Current) -> None:
    """Install only the preemption handlers (a single process keeps Python's own Ctrl-C)."""
    if not process.in_main_thread():
        return
    for signum in STOP_SIGNALS:
        if process.signal_handler(signum) in (signal.SIG_DFL, None):
            process.set_signal_handler(signum, partial(_on_stop_signal, current))


def _on_interrupt(current: Current, signum: int, frame: FrameType | None) -> None:
    record = current().process
    if record.interrupted:
        return  # the terminal and the launcher may both deliver Ctrl-C: act once
    record.interrupted = True
    timer = threading.Timer(INTERRUPT_GRACE_SECONDS, _interrupt_exit, args=(current,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _interrupt_exit(current: Current) -> None:
    rank = current()
    record = rank.process
    record.exit_lock.acquire()  # the grace timer and the main thread may both get here: print once
    record.post_fault(f"rank {record.number} (host {HOST}, pid {os.getpid()}) was interrupted (SIGINT)")
    if record.number in (0, None):
        where = rank.describe() if rank.world_size > 1 else ""  # one process: Python's own Ctrl-C
        number = "" if record.number is None else f"{HOST}: rank {record.number} "
        write_stderr(f"[minifabric] {number}interrupted{' ' + where if where else ''}\n")
        record.let_local_peers_end(timeout=1.0)  # they post to the store this process may hold
    process.hard_exit(INTERRUPTED_EXIT_CODE)


def _on_stop_signal(current: Current, signum: int, frame: FrameType | None) -> None:
    rank = current()
    record = rank.process
    if record.stop_signal is None and rank.holds_stop_signals():
        record.stop_signal = signum
        return
    # nobody asks for a graceful stop (or this is the second signal): end as without minifabric
    record.failed = True
    culprit = record.culprit(wait=0.5)
    if culprit is not None:  # e.g. torchrun's agent ending the ranks after another one failed
        write_stderr(f"[minifabric] {HOST}: rank {record.number} stopped: {culprit}\n")
    elif record.number is not None:  # one rank of several: say which one ended (one process: silent)
        name = signal.Signals(signum).name
        write_stderr(f"[minifabric] {HOST}: rank {record.number} was ended by {name}\n")
        record.post_fault(f"rank {record.number} (host {HOST}, pid {os.getpid()}) was ended by {name}")
    process.end_by_signal(signum)


def _visible(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without the frames of the launcher's script runner."""
    while tb is not None and tb.tb_frame.f_code.co_filename.endswith(_HIDDEN_FRAMES):
        tb = tb.tb_next
    return tb


def format_stack(frames: traceback.StackSummary) -> str:
    """Format stack entries, leaving out the launcher's script runner."""
    shown = [f for f in frames if not f.filename.endswith(_HIDDEN_FRAMES)]
    return "".join(traceback.StackSummary.from_list(shown).format())


def _excepthook(
    current: Current, previous: Callable, tp: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    record = current().process
    if record.interrupted or issubclass(tp, KeyboardInterrupt):
        record.interrupted = True
        _interrupt_exit(current)
    record.failed = True
    rank = "" if record.number is None else f" {record.number}"
    lost = [p for p in _PEER_LOST if isinstance(value, RuntimeError) and p in str(value)]
    if isinstance(value, PeerFailed):
        write_stderr(f"[minifabric] {HOST}: rank{rank} stopped: {value}\n")
    elif lost:
        culprit = record.culprit(wait=2.0) or f"another rank ended first ({lost[0]})"
        write_stderr(f"[minifabric] {HOST}: rank{rank} stopped: {culprit}\n")
    elif not record.report(value):  # e.g. a collective timeout, reported with every rank's stack
        _report_failure(current, tp, value)
        tb = _visible(tb)
        previous(tp, value.with_traceback(tb), tb)
    record.end(1)


def _report_failure(current: Current, tp: type[BaseException], value: BaseException, where: str = "") -> None:
    """Print this rank's one-line cause and post it for the other ranks."""
    record = current().process
    rank = "" if record.number is None else f" {record.number}"
    text = str(value)
    cause = f"{tp.__name__}{where}" + (f": {text}" if text else "")
    first = f"{tp.__name__}{where}" + (f": {text.splitlines()[0]}" if text else "")
    write_stderr(f"[minifabric] {HOST}: rank{rank} failed with {cause}\n")
    record.post_fault(f"rank{rank} (host {HOST}, pid {os.getpid()}) failed with {first}")


def _thread_excepthook(current: Current, args: threading.ExceptHookArgs) -> None:
    """An uncaught exception in a thread the user started ends the rank, as one in the main thread does."""
    if args.exc_type is SystemExit:  # threading's own rule: a thread's SystemExit ends only the thread
        return
    record = current().process
    record.failed = True
    value = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else "?"
    _report_failure(current, args.exc_type, value, where=f" in thread {name!r}")
    traceback.print_exception(args.exc_type, value, _visible(args.exc_traceback), file=sys.__stderr__)
    record.end(1)
