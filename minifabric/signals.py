"""How a rank reacts to signals and to its own end: Ctrl-C, preemption, uncaught exceptions.

Signals belong to the whole process, so this module keeps one small record per process (which
rank it is, whether it was interrupted or asked to stop) and installs its handlers once, only
where the user has not installed their own.

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
  (:mod:`minifabric.heartbeat`); a rank that only lost the connection to a rank that failed first
  prints one line naming that rank instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import NoReturn

from minifabric import heartbeat, process
from minifabric.heartbeat import HOST
from minifabric.process import write_stderr

__all__ = ["write_stderr"]  # re-exported: callers report through this module

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
_HIDDEN_FRAMES = ("runpy.py", "<frozen runpy>", os.path.join("minifabric", "_run.py"))


class PeerFailed(RuntimeError):
    """Raised on the ranks that learn that another rank failed; reported in one line, no traceback."""


class _Process:
    """What this process knows about itself (one per process: signals are process-wide)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.failed = False
        self.interrupted = False
        self.stop_signal: int | None = None  # the preemption signal received, if any
        self.hold_stop: Callable[[], bool] = lambda: False  # True: a preemption signal only sets a flag
        self.describe: Callable[[], str] = lambda: ""
        self.report: Callable[[BaseException], bool] = lambda error: False


_process = _Process()
_hook: Callable | None = None  # this module's exception hook, once installed


def reclaim_excepthook() -> None:
    """Put this module's exception hook back in front (``init_process_group`` wraps it in its own)."""
    if _hook is not None:
        process.set_excepthook(_hook)


def leave(code: int) -> NoReturn:
    """End this process now with ``code``: exit handlers run, the interpreter's slow teardown does not."""
    _process.failed = _process.failed or code != 0
    process.leave(code)


def ending_badly() -> bool:
    """Whether this process is ending with an error or an interrupt (set before exit handlers run)."""
    return _process.failed or _process.interrupted or getattr(sys, "last_value", None) is not None


def report_errors_with(report: Callable[[BaseException], bool]) -> None:
    """Let ``report(error)`` handle an uncaught error first (it returns True if it reported it)."""
    _process.report = report


def stop_requested() -> bool:
    """Whether this process received a preemption signal (SIGTERM or SIGUSR1)."""
    return _process.stop_signal is not None


def hold_stop_signals_while(condition: Callable[[], bool]) -> None:
    """A preemption signal only sets the flag that ``should_stop`` reports while ``condition()`` holds.

    The lifecycle passes "the loop has read ``should_stop``": a script that never asks keeps the
    default action of the signal (the process ends).
    """
    _process.hold_stop = condition


def install(rank: int | None = None, describe: Callable[[], str] | None = None) -> None:
    """Install the handlers in this process (once; signal handlers only from the main thread).

    Args:
        rank: global rank, for messages (None: not known yet, e.g. before ``launch()``).
        describe: returns where the run is (``"at step N; last committed checkpoint: PATH"``), for
            the Ctrl-C message.
    """
    if rank is not None:
        _process.rank = rank
    if describe is not None:
        _process.describe = describe
    global _hook
    if _hook is None:
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            _excepthook(previous, tp, value, tb)

        _hook = hook
    process.set_excepthook(_hook)
    process.set_thread_excepthook(_thread_excepthook)
    heartbeat.quiet_while(ending_badly)
    if process.in_main_thread():
        if process.signal_handler(signal.SIGINT) is signal.default_int_handler:
            process.set_signal_handler(signal.SIGINT, _on_interrupt)
    install_stop_signals()


def install_stop_signals() -> None:
    """Install only the preemption handlers (a single process keeps Python's own Ctrl-C)."""
    if not process.in_main_thread():
        return
    for signum in STOP_SIGNALS:
        if process.signal_handler(signum) in (signal.SIG_DFL, None):
            process.set_signal_handler(signum, _on_stop_signal)


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    if _process.interrupted:
        return  # the terminal and the launcher may both deliver Ctrl-C: act once
    _process.interrupted = True
    timer = threading.Timer(INTERRUPT_GRACE_SECONDS, _interrupt_exit)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


_exit_lock = threading.Lock()


def _interrupt_exit() -> None:
    _exit_lock.acquire()  # the grace timer and the main thread may both get here: print once
    heartbeat.post_fault(f"rank {_process.rank} (host {HOST}, pid {os.getpid()}) was interrupted (SIGINT)")
    if _process.rank in (0, None):
        where = _process.describe()
        rank = "" if _process.rank is None else f"{HOST}: rank {_process.rank} "
        write_stderr(f"[minifabric] {rank}interrupted{' ' + where if where else ''}\n")
        heartbeat.let_local_peers_end(timeout=1.0)  # they post to the store this process may hold
    process.hard_exit(INTERRUPTED_EXIT_CODE)


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    if _process.stop_signal is None and _process.hold_stop():
        _process.stop_signal = signum
        return
    # nobody asks for a graceful stop (or this is the second signal): end as without minifabric
    _process.failed = True
    culprit = heartbeat.culprit(wait=0.5)
    if culprit is not None:  # e.g. torchrun's agent ending the ranks after another one failed
        write_stderr(f"[minifabric] {HOST}: rank {_process.rank} stopped: {culprit}\n")
    elif _process.rank is not None:  # one rank of several: say which one ended (one process: silent)
        name = signal.Signals(signum).name
        write_stderr(f"[minifabric] {HOST}: rank {_process.rank} was ended by {name}\n")
        heartbeat.post_fault(f"rank {_process.rank} (host {HOST}, pid {os.getpid()}) was ended by {name}")
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
    previous: Callable, tp: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    if _process.interrupted or issubclass(tp, KeyboardInterrupt):
        _process.interrupted = True
        _interrupt_exit()
    _process.failed = True
    rank = "" if _process.rank is None else f" {_process.rank}"
    lost = [p for p in _PEER_LOST if isinstance(value, RuntimeError) and p in str(value)]
    if isinstance(value, PeerFailed):
        write_stderr(f"[minifabric] {HOST}: rank{rank} stopped: {value}\n")
    elif lost:
        culprit = heartbeat.culprit(wait=2.0) or f"another rank ended first ({lost[0]})"
        write_stderr(f"[minifabric] {HOST}: rank{rank} stopped: {culprit}\n")
    elif not _process.report(value):  # e.g. a collective timeout, reported with every rank's stack
        _report_failure(tp, value)
        tb = _visible(tb)
        previous(tp, value.with_traceback(tb), tb)
    leave(1)


def _report_failure(tp: type[BaseException], value: BaseException, where: str = "") -> None:
    """Print this rank's one-line cause and post it for the other ranks."""
    rank = "" if _process.rank is None else f" {_process.rank}"
    text = str(value)
    cause = f"{tp.__name__}{where}" + (f": {text}" if text else "")
    first = f"{tp.__name__}{where}" + (f": {text.splitlines()[0]}" if text else "")
    write_stderr(f"[minifabric] {HOST}: rank{rank} failed with {cause}\n")
    heartbeat.post_fault(f"rank{rank} (host {HOST}, pid {os.getpid()}) failed with {first}")


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """An uncaught exception in a thread the user started ends the rank, as one in the main thread does."""
    if args.exc_type is SystemExit:  # threading's own rule: a thread's SystemExit ends only the thread
        return
    _process.failed = True
    value = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else "?"
    _report_failure(args.exc_type, value, where=f" in thread {name!r}")
    traceback.print_exception(args.exc_type, value, _visible(args.exc_traceback), file=sys.__stderr__)
    leave(1)
