"""Launchers start (or join) the processes of a run and make a failure on one rank end them all.

- :class:`JoinLauncher`: the processes already exist (one process, torchrun, SLURM, LSF, MPI, or a
  rank started by :class:`LocalLauncher`): join the process group and run.
- :class:`LocalLauncher`: this node has more than one device and nothing started the processes.
  ``launch()`` re-runs the current script once per local rank, as torchrun would, and this process
  becomes their supervisor; ``launch(fn, *args)`` spawns fresh processes that each call
  ``fn(accelerator, *args)`` and returns rank 0's result.

The supervisor ends every rank as soon as one exits with an error (and exits with that rank's
code), forwards Ctrl-C, SIGTERM and SIGUSR1 to the ranks, and ends them if Ctrl-C did not within a
few seconds. Each rank dies with its supervisor (``PR_SET_PDEATHSIG`` on Linux), so nothing is
left behind and nothing waits for a collective timeout. Under torchrun its agent does the same;
under SLURM use ``srun --kill-on-bad-exit=1``.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from minifabric import process
from minifabric.runtime import rank as this_rank
from minifabric.runtime import signals
from minifabric.runtime.environment import find_free_port
from minifabric.runtime.heartbeat import HOST

_POLL_SECONDS = 0.05


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
    """Starts ``num_processes`` local processes on a single node and supervises them.

    Args:
        num_processes: processes to run on this machine.
        main_address: the address rank 0 listens on.
    """

    creates_processes = True

    def __init__(self, num_processes: int, main_address: str = "127.0.0.1") -> None:
        self.num_processes = num_processes
        self.main_address = main_address

    def launch(self, join: Callable[[], None], function: Callable | None, *args: Any) -> Any:
        if function is None:
            command = _script_command()
            envs = _world_envs(self.num_processes, self.main_address)
            ranks = {rank: _ScriptRank(command, env) for rank, env in enumerate(envs)}
            code = _Supervisor(ranks).run()
            # this process only supervised: skip the interpreter's teardown (seconds with torch loaded)
            process.hard_exit(code)
        return _spawn(self.num_processes, self.main_address, join, function, args)


def _world_envs(num_processes: int, main_address: str) -> list[dict[str, str]]:
    """The variables each local rank is started with (one port, chosen once, for every rank)."""
    port = os.environ.get("MASTER_PORT") or str(find_free_port())
    world = {
        "MASTER_ADDR": main_address,
        "MASTER_PORT": port,
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "NODE_RANK": "0",
        process.PARENT_PID_VAR: str(os.getpid()),
    }
    return [{**world, "LOCAL_RANK": str(rank)} for rank in range(num_processes)]


def _script_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    runner = [sys.executable, "-m", "minifabric.runtime.run_script"]
    if spec is not None and spec.name not in ("__main__", None):
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [*runner, "-m", module, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        raise RuntimeError(
            "`acc.launch()` re-runs the current script for every rank, but this process was not"
            " started from a script file (interactive session or `python -c`). Pass a function instead:"
            " `acc.launch(train_fn)`, where `def train_fn(acc): ...`."
        )
    return [*runner, os.path.abspath(script), *sys.argv[1:]]


# ---- the supervisor ----------------------------------------------------------------------------


class _ScriptRank:
    """One rank started as ``python -m minifabric.runtime.run_script script.py ...``."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, env={**os.environ, **env})

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()


class _SpawnedRank:
    """One rank started with multiprocessing's ``spawn``."""

    def __init__(self, process: Any) -> None:
        self.process = process
        process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.exitcode


def _shell_code(code: int) -> int:
    """An exit code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == signals.INTERRUPTED_EXIT_CODE:
        return f"exited with code {code} (interrupted: SIGINT)"
    return f"exited with code {code}"


class _Supervisor:
    """Runs in the launching process: waits for the ranks and ends them all when one fails."""

    def __init__(self, ranks: dict[int, Any]) -> None:
        self.ranks = ranks
        self.interrupted_at: float | None = None
        self.stop_signals = 0

    def _signal_all(self, signum: int) -> None:
        for rank in self.ranks.values():
            if rank.exit_code() is None:
                try:
                    os.kill(rank.pid, signum)
                except ProcessLookupError:
                    pass

    def _say_killing(self, why: str) -> None:
        """Print which ranks are about to be killed and why (whatever kills a rank says why first)."""
        running = [rank for rank, proc in self.ranks.items() if proc.exit_code() is None]
        if running:
            process.write_stderr(f"[minifabric] {HOST}: killing rank(s) {running}: {why}.\n")

    def _kill_all(self, why: str = "") -> None:
        """SIGKILL every rank still running, after saying ``why`` (unless said already), and wait for them."""
        if why:
            self._say_killing(why)
        self._signal_all(signal.SIGKILL)
        for rank in self.ranks.values():
            while rank.exit_code() is None:
                time.sleep(_POLL_SECONDS)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self._signal_all(signal.SIGINT)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signals += 1
        # the first is forwarded (the ranks stop at a step boundary if the loop reads should_stop);
        # a second one ends them
        if self.stop_signals == 1:
            self._signal_all(signum)
        else:
            self._say_killing(f"a second {signal.Signals(signum).name} reached the launcher")
            self._signal_all(signal.SIGKILL)

    def run(self) -> int:
        """Wait for every rank; return the exit code of the run (as a shell reports it)."""
        forward: dict[int, Any] = {
            signal.SIGINT: self._on_interrupt,
            **dict.fromkeys(signals.STOP_SIGNALS, self._on_stop),
        }
        with process.signal_handlers(forward):
            try:
                return self._wait()
            except BaseException as error:
                self._kill_all(f"the launcher failed ({type(error).__name__})")
                raise

    def _wait(self) -> int:
        while True:
            codes = {rank: proc.exit_code() for rank, proc in self.ranks.items()}
            if self.interrupted_at is not None:
                late = time.monotonic() - self.interrupted_at > signals.INTERRUPT_GRACE_SECONDS + 0.5
                if late or all(code is not None for code in codes.values()):
                    grace = signals.INTERRUPT_GRACE_SECONDS
                    self._kill_all(f"still running {grace:g}s after Ctrl-C" if late else "")
                    return signals.INTERRUPTED_EXIT_CODE
            else:
                failed = [(rank, code) for rank, code in codes.items() if code not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    process.write_stderr(
                        f"[minifabric] {HOST}: rank {rank} {_describe_exit(code)}: stopping every rank.\n"
                    )
                    self._kill_all()
                    return _shell_code(code)
                if all(code == 0 for code in codes.values()):
                    return 0
            time.sleep(_POLL_SECONDS)


# ---- launch(fn) --------------------------------------------------------------------------------


def _spawn_entry(env: dict[str, str], payload: bytes, result_path: str) -> None:
    process.become_rank(env)
    join, function, args = pickle.loads(payload)
    this_rank.install_signals(int(env["LOCAL_RANK"]))
    process.die_with_parent()
    try:
        join()
        result = function(*args)
    except SystemExit as end:
        if end.code in (None, 0):
            raise
        this_rank.end(end.code if isinstance(end.code, int) else 1)
    except BaseException:
        # report it as an uncaught exception in a script is (multiprocessing would print its own
        # traceback instead); the hook ends the process
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
        this_rank.end(1)
    if env["LOCAL_RANK"] == "0":
        # a file, not a pipe: the result may be large and is read only after every rank has ended
        with open(result_path, "wb") as f:
            pickle.dump(result, f)


def _spawn(num_processes: int, main_address: str, join: Callable, function: Callable, args: tuple) -> Any:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    # Pickled here, with the plain pickler, so each rank unpickles its own copy of the model and
    # tensors it is passed (multiprocessing's pickler would put them in memory shared by every
    # rank, and each rank's optimizer step would update the same weights), as Fabric's launcher does.
    payload = pickle.dumps((join, function, args))
    with tempfile.TemporaryDirectory(prefix="minifabric-launch-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        ranks = {
            rank: _SpawnedRank(
                context.Process(
                    target=_spawn_entry, args=(env, payload, result_path), name=f"minifabric-rank-{rank}"
                )
            )
            for rank, env in enumerate(_world_envs(num_processes, main_address))
        }
        code = _Supervisor(ranks).run()
        if code != 0:
            raise SystemExit(code)
        return pickle.loads(Path(result_path).read_bytes()) if os.path.exists(result_path) else None
