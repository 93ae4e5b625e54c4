"""Process-wide switches that are not torch's: the exception hook, signals, exit, environment variables.

A Python process has one ``sys.excepthook``, one handler per signal, one list of exit handlers and
one environment (``os.environ``), shared by the user's code, torch and minifabric. Changing any of them changes the whole process,
so minifabric does it only here (torch's own switches are in :mod:`minifabric._torch`): each
switch is one named helper that says why it exists and gives back a way to undo it (a context
manager, or a returned ``undo``). ``tests/unit/test_process_switches.py`` checks that no other
module sets one.

It also keeps the little that is shared by every Accelerator and thread of the process (at its
end): a sequence of numbers, the use count of a shared patch, and the one background chore of a
kind (the deletion of replaced checkpoint versions). Besides :mod:`minifabric.runtime.rank`, it is
the only module with module-level state (``tests/unit/test_module_state.py``).

This module is the bottom layer: it imports nothing from minifabric.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def set_excepthook(hook: Callable[..., Any]) -> Callable[[], None]:
    """Make ``hook`` the process's ``sys.excepthook``; return a function that puts the previous one back.

    Why: an uncaught exception on one rank must be reported with the rank's number and end the
    process at once (the launcher then ends the others), not after the interpreter's slow teardown.
    """
    return _replace(sys, "excepthook", hook)


def set_thread_excepthook(hook: Callable[[threading.ExceptHookArgs], Any]) -> Callable[[], None]:
    """Make ``hook`` the process's ``threading.excepthook``; return a function that restores the previous one.

    Why: by default an exception in a thread the user started prints a traceback and ends only
    that thread, and training goes on without it (a data-loading thread, a logger). A rank ends
    instead, as for an exception in the main thread, so the run does not go on half-broken.
    """
    return _replace(threading, "excepthook", hook)


def _replace(owner: Any, name: str, hook: Callable[..., Any]) -> Callable[[], None]:
    """Set ``owner.name`` to ``hook``; return an undo that restores the previous value while ``hook`` is still set."""
    previous = getattr(owner, name)
    setattr(owner, name, hook)

    def undo() -> None:
        if getattr(owner, name) is hook:
            setattr(owner, name, previous)

    return undo


def in_main_thread() -> bool:
    """Whether this is the main thread (the only one that may install signal handlers)."""
    return threading.current_thread() is threading.main_thread()


def set_signal_handler(signum: int, handler: Handler) -> Handler:
    """Install ``handler`` for ``signum`` (main thread only); return the handler it replaced.

    Why: Ctrl-C and preemption signals of a rank are turned into a clean end or a stop flag
    (:mod:`minifabric.runtime.signals`); the caller keeps the returned handler to restore it.
    """
    return signal.signal(signum, handler)


def signal_handler(signum: int) -> Handler:
    """The handler installed for ``signum`` now."""
    return signal.getsignal(signum)


@contextmanager
def signal_handlers(handlers: dict[int, Handler]) -> Iterator[None]:
    """Inside, ``handlers`` handle their signals; the previous handlers are restored on exit.

    Why: the process that supervises local ranks forwards Ctrl-C and preemption signals to them
    while it waits, and only while it waits. Outside the main thread (where Python forbids
    signal handlers) this does nothing.
    """
    if not in_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def end_by_signal(signum: int) -> None:
    """End this process with the default action of ``signum``, as if no handler had been installed.

    Why: a preemption signal that nobody asked to hold must end the process as it would without
    minifabric (exit status "killed by SIGTERM", which launchers and schedulers understand).
    """
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def at_exit(function: Callable[[], None]) -> Callable[[], None]:
    """Run ``function`` at interpreter exit; return a function that cancels that.

    Why: a rank leaves the process group together with the others when the script ends, so no
    rank tears down a connection another one still uses.
    """
    atexit.register(function)
    return lambda: atexit.unregister(function)


def write_stderr(text: str) -> None:
    """Write to the process's real stderr and flush both streams (safe at exit)."""
    try:
        sys.stdout.flush()
        stderr = sys.__stderr__ or sys.stderr  # torch's rank-prefixing hook may have swapped sys.stderr
        stderr.write(text)
        stderr.flush()
    except (OSError, ValueError):  # a closed stream at exit
        pass


def hard_exit(code: int) -> NoReturn:
    """End this process now with ``code``: no exit handlers, no interpreter teardown.

    Why: a rank that must end (its peer failed, a hang was detected, Ctrl-C's grace ran out) may
    have threads stuck in C calls; only ``os._exit`` is sure to end it.
    """
    write_stderr("")
    os._exit(code)


def end(code: int) -> NoReturn:
    """End this process now with ``code`` after running the exit handlers, skipping the slow teardown.

    Why: a failing rank must be gone quickly so the launcher can end the others; tearing down an
    interpreter with torch loaded takes seconds on a busy machine. Exit handlers (a pending
    background save's report, the user's own) still run, through CPython's ``atexit._run_exitfuncs``.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        hard_exit(code)


#: environment variable: the pid of the process that started this rank (minifabric's launcher)
PARENT_PID_VAR = "MINIFABRIC_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a rank started by minifabric's launcher: end as soon as the launching process is gone.

    Why: a rank whose launcher died (killed, or ended by its own failure) would otherwise run on,
    or wait in a collective until its timeout. On Linux the kernel sends SIGKILL when the parent
    exits (``PR_SET_PDEATHSIG``); elsewhere a thread polls for it. Kept for the life of the process.
    """
    parent = os.environ.get(PARENT_PID_VAR)
    if parent is None or int(parent) == os.getpid():
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        kernel_watch = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        kernel_watch = False
    if os.getppid() != int(parent):  # the parent died before the watch was set
        hard_exit(1)
    if kernel_watch:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(0.1)
        hard_exit(1)

    threading.Thread(target=watch, name="minifabric-parent-watch", daemon=True).start()


def swap_class(obj: Any, cls: type) -> Callable[[], None]:
    """Give the live object ``obj`` the class ``cls`` (a subclass of its own); return the undo.

    Why: Lightning's utilities check ``isinstance`` against their own precision classes; a
    minifabric plugin is presented to them as a subclass of both, without copying the object that
    the strategy holds.
    """
    previous = type(obj)
    obj.__class__ = cls

    def undo() -> None:
        obj.__class__ = previous

    return undo


# ---- environment variables -----------------------------------------------------------------------
# The environment is read by the user's code, torch, Lightning and every process this one starts.
# Building a dict for a child process (``{**os.environ, ...}`` passed to ``Popen``) changes nothing
# here and needs no helper.


@contextmanager
def scoped_environment(
    values: Mapping[str, str] | None = None, defaults: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Inside, ``values`` are set and ``defaults`` are set where unset; on exit each variable is as before.

    Why: some programs this process starts read their settings only from the environment, and only
    as they start (torchrun's agent passes its environment on to the ranks; torchft's servers read
    ``RUST_LOG``). The variables are set for that start and taken back afterwards, so a call from the
    user's own process (``minifabric.cli.main([...])``, a replica group) leaves their environment as it was.
    """
    wanted = dict(values or {})
    wanted.update({name: value for name, value in (defaults or {}).items() if name not in os.environ})
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def become_rank(variables: Mapping[str, str]) -> None:
    """Put this rank's place in the run (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) in its environment.

    Why: a rank started by ``launch(fn)`` (multiprocessing spawn) inherits its parent's environment,
    not the variables torchrun gives a rank, and minifabric, torch and Lightning's helpers read the
    rank's place from there. Kept for the life of the process, which is that rank.
    """
    os.environ.update(variables)


def publish_main_address(address: str, port: int) -> None:
    """Set ``MASTER_ADDR`` and ``MASTER_PORT`` to the address the process group was created with.

    Why: the address may have been found rather than given (from a scheduler's node list, or a
    default); whatever reads these variables after the join (the environment's ``main_address``, a
    replica group's store, a library that opens its own connection to rank 0) must reach the same
    rank 0. Kept for the life of the process, as torchrun's variables are.
    """
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)


def export_seed(seed: int, workers: bool) -> None:
    """Set ``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS``, as Lightning's ``seed_everything`` does.

    Why: Lightning's data-loader worker seeding (``pl_worker_init_function``), a later
    ``seed_everything()`` without a seed and the processes this one starts read the run's seed
    from there. Kept: the seed is the run's.
    """
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))


def forget_world_size() -> None:
    """Remove ``WORLD_SIZE`` from the environment, as Lightning's ``LightningEnvironment.teardown`` does.

    Why: a ``WORLD_SIZE`` left from a finished run would be read as the size of the next run
    started from this process.
    """
    os.environ.pop("WORLD_SIZE", None)


# ---- process-wide bookkeeping -------------------------------------------------------------------
# The state of this module and of `runtime/rank.py` is the only module-level state of minifabric
# (tests/unit/test_module_state.py): what is shared by every Accelerator and thread of the process.

_numbers = itertools.count()
_patches_lock = threading.Lock()
_patches: dict[str, tuple[int, Callable[[], None]]] = {}  # name -> (open blocks, undo)
_chores_lock = threading.Lock()
_chores: dict[str, threading.Thread] = {}  # name -> the thread of the last chore of that name
_once_lock = threading.Lock()
_once: set[str] = set()  # the names once() has seen


_facts_lock = threading.Lock()
_facts: dict[Any, Any] = {}  # key -> what fact() computed for it


def fact(key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` for ``key``, computed at the first call in this process and remembered after: for
    what cannot change while the process runs (how this torch's kernels behave on a device)."""
    with _facts_lock:
        if key not in _facts:
            _facts[key] = compute()
        return _facts[key]


def once(name: str) -> bool:
    """True at the first call with ``name`` in this process, False after (thread-safe): a warning shown once."""
    with _once_lock:
        first = name not in _once
        _once.add(name)
        return first


def next_number() -> int:
    """A number no earlier call in this process returned (increasing; thread-safe)."""
    return next(_numbers)


@contextmanager
def shared_patch(name: str, install: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """Inside, the process-wide patch ``name`` is installed: by the first block to open, undone by the last.

    ``install()`` patches and returns its undo. Blocks in several threads may open and end in any
    order; the patch is installed once and restored once, after the last block ends.
    """
    with _patches_lock:
        users, undo = _patches.get(name, (0, None))
        if not users:
            undo = install()
        _patches[name] = (users + 1, undo)  # type: ignore[assignment]
    try:
        yield
    finally:
        with _patches_lock:
            users, undo = _patches.pop(name)
            if users > 1:
                _patches[name] = (users - 1, undo)
            else:
                undo()


def run_chore(name: str, prepare: Callable[[], Callable[[], None] | None]) -> None:
    """Run a chore on a background thread ``name``, after the previous chore of that name ended.

    ``prepare()`` runs here, after that previous chore ended, and returns the work for the thread
    (or None: nothing to do). The thread is not a daemon, so the interpreter finishes the work
    before it exits. Where no thread can start (at interpreter shutdown) the work runs here.
    """
    with _chores_lock:
        _join_chore(name)
        work = prepare()
        if work is None:
            return
        thread = threading.Thread(target=work, name=name)
        try:
            thread.start()
        except RuntimeError:  # no new thread now (Python 3.12 at interpreter shutdown): work here
            work()
            return
        _chores[name] = thread


def wait_for_chore(name: str) -> None:
    """Wait until the last chore ``name`` ended."""
    with _chores_lock:
        _join_chore(name)


def _join_chore(name: str) -> None:
    thread = _chores.pop(name, None)
    if thread is not None:
        thread.join()
