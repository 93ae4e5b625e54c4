"""Launchers start (or join) the processes of a run and make a failure on one rank end them all.

- :class:`JoinLauncher`: the processes already exist (one process, torchrun, SLURM, LSF, MPI, or a
  child started by :class:`LocalLauncher`): join the process group and run.
- :class:`LocalLauncher`: this node has more than one device and nothing started the other
  processes. ``launch()`` re-runs the current script once per extra local rank, as torchrun would;
  ``launch(fn, *args)`` spawns fresh processes that each call ``fn(accelerator, *args)``.

Fail fast: every rank prints ``[minifabric] rank R failed`` with its traceback on an uncaught
exception. Under :class:`LocalLauncher` rank 0 watches its children and kills every rank as soon
as one exits with an error, and each child exits when rank 0 disappears, so nothing waits for a
collective timeout. Under torchrun its agent does the same; under SLURM use ``srun --kill-on-bad-exit=1``.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch.multiprocessing as mp

from minifabric.environment import find_free_port

_PARENT_PID_VAR = "MINIFABRIC_PARENT_PID"
_POLL_SECONDS = 0.1


class Launcher(ABC):
    """Starts or joins the processes of a run."""

    #: whether ``launch()`` must be called before the run can use more than this process
    creates_processes: bool = False

    @abstractmethod
    def launch(self, join: Callable[[], None], function: Callable | None, *args: Any) -> Any:
        """Make sure every rank runs; call ``join()`` in each process, then ``function(*args)`` if given."""


class JoinLauncher(Launcher):
    """The processes exist already: join them and run in this process."""

    def launch(self, join: Callable[[], None], function: Callable | None, *args: Any) -> Any:
        join()
        return function(*args) if function is not None else None


class LocalLauncher(Launcher):
    """Starts ``num_processes`` local processes on a single node.

    Args:
        num_processes: processes to run on this machine, this one included.
        main_address: the address rank 0 listens on.
    """

    creates_processes = True

    def __init__(self, num_processes: int, main_address: str = "127.0.0.1") -> None:
        self.num_processes = num_processes
        self.main_address = main_address

    def launch(self, join: Callable[[], None], function: Callable | None, *args: Any) -> Any:
        if function is None:
            _start_script_children(self.num_processes, self.main_address)
            join()
            return None
        return _spawn(self.num_processes, self.main_address, join, function, args)


def _world_env(num_processes: int, main_address: str, local_rank: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": main_address,
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(find_free_port()),
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "NODE_RANK": "0",
        "LOCAL_RANK": str(local_rank),
        _PARENT_PID_VAR: str(os.getpid()),
    }


def _script_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        raise RuntimeError(
            "`acc.launch()` re-runs the current script for the other ranks, but this process was not"
            " started from a script file (interactive session or `python -c`). Pass a function instead:"
            " `acc.launch(train_fn)`, where `def train_fn(acc): ...`."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


def _start_script_children(num_processes: int, main_address: str) -> None:
    command = _script_command()
    base = _world_env(num_processes, main_address, 0)
    os.environ.update(base)  # rank 0 is this process
    children: dict[int, subprocess.Popen] = {}
    for local_rank in range(1, num_processes):
        env = {**os.environ, **base, "LOCAL_RANK": str(local_rank)}
        children[local_rank] = subprocess.Popen(command, env=env)
    _ChildSupervisor(children).start()


class _ChildSupervisor:
    """Runs in rank 0: ends every rank as soon as one fails; waits for all at a normal exit."""

    def __init__(self, children: dict[int, subprocess.Popen]) -> None:
        self.children = children
        self.failed = False

    def start(self) -> None:
        threading.Thread(target=self._watch, name="minifabric-supervisor", daemon=True).start()
        atexit.register(self._at_exit)
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            self.failed = True
            previous(tp, value, tb)

        sys.excepthook = hook

    def _kill_all(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()

    def _watch(self) -> None:
        while True:
            for rank, child in self.children.items():
                code = child.poll()
                if code is not None and code != 0:
                    sys.stderr.write(
                        f"[minifabric] rank {rank} exited with code {code}: stopping every rank.\n"
                    )
                    sys.stderr.flush()
                    self._kill_all()
                    os._exit(1)
            time.sleep(_POLL_SECONDS)

    def _at_exit(self) -> None:
        if self.failed:
            self._kill_all()
            return
        for child in self.children.values():
            child.wait()


def watch_parent() -> None:
    """In a child started by :class:`LocalLauncher`: exit as soon as rank 0's process is gone."""
    parent = os.environ.get(_PARENT_PID_VAR)
    if parent is None or int(parent) == os.getpid():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="minifabric-parent-watch", daemon=True).start()


def install_rank_excepthook(rank: int) -> None:
    """Print ``[minifabric] rank R failed`` before the traceback of an uncaught exception."""
    previous = sys.excepthook
    if getattr(previous, "_minifabric_rank", None) is not None:
        return

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        sys.stderr.write(f"[minifabric] rank {rank} failed with {tp.__name__}: {value}\n")
        previous(tp, value, tb)
        sys.stderr.flush()

    hook._minifabric_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = hook


def _spawn_entry(
    local_rank: int,
    env: dict[str, str],
    join: Callable[[], None],
    function: Callable,
    args: tuple,
    results: Any,
) -> None:
    os.environ.update({**env, "LOCAL_RANK": str(local_rank)})
    try:
        join()
        result = function(*args)
    except BaseException as error:
        sys.stderr.write(f"[minifabric] rank {local_rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        # torch.multiprocessing reports the exception itself, so the interpreter never records it as
        # uncaught; record it as it would, so exit handlers know not to wait for the other ranks.
        sys.last_value = error
        raise
    if local_rank == 0:
        results.put(result)


def _spawn(num_processes: int, main_address: str, join: Callable, function: Callable, args: tuple) -> Any:
    env = _world_env(num_processes, main_address, 0)
    env.pop(_PARENT_PID_VAR)  # spawned processes are supervised by torch.multiprocessing
    results = mp.get_context("spawn").SimpleQueue()
    # join() raises in the parent as soon as one process fails, after terminating the others.
    mp.start_processes(
        _spawn_entry, args=(env, join, function, args, results), nprocs=num_processes, start_method="spawn"
    )
    return results.get() if not results.empty() else None
