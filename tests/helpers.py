"""Run a function on N real processes (gloo, CPU) and collect every rank's result, with a timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple, box: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensors into the message (the queue's own pickler would share them
        # through file descriptors that die with this process before the parent reads them).
        box.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:
        box.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(start_method: str) -> Any:
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        # Ranks fork from a server that has imported torch and minifabric once: a 2-rank run then
        # starts in well under a second instead of re-importing everything in every process.
        context.set_forkserver_preload(
            ["torch", "torch.distributed.checkpoint", "minifabric", "tests.models"]
        )
    return context


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180, start_method: str = "forkserver"
) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` fresh processes; return every rank's result, by rank.

    ``fn`` must be defined at module level. Raises ``RuntimeError`` if a rank dies without a result
    (e.g. killed), ``AssertionError`` with the tracebacks if a rank raises, ``TimeoutError`` after
    ``timeout`` seconds; never hangs. ``start_method="spawn"`` starts every rank from a bare
    interpreter (for memory measurements).
    """
    context = _context(start_method)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    box = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(fn, r, world_size, port, args, box))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size and not errors:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks exceeded {timeout}s; finished: {sorted(results)}"
                )
            try:
                rank, status, value = box.get(timeout=0.2)
                (results if status == "ok" else errors)[rank] = value
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    time.sleep(0.5)  # let a failing rank's traceback arrive
                    while not box.empty():
                        rank, status, value = box.get()
                        (results if status == "ok" else errors)[rank] = value
                    if not errors:
                        raise RuntimeError(
                            f"ranks {dead} died without a result (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
    finally:
        grace = 5 if len(results) == world_size else 0.5
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    return [pickle.loads(results[r]) for r in range(world_size)]


def command_env(env: dict | None = None) -> dict[str, str]:
    """The environment for a subprocess: the repo on PYTHONPATH, one thread, no inherited rank variables."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    for var in (
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
    ):
        if env is None or var not in env:
            full_env.pop(var, None)
    return full_env


def run_command(
    cmd: list[str], timeout: float = 120, cwd: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a command with the repo on PYTHONPATH; kill it (and fail) after ``timeout`` seconds."""
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=command_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


PYTHON = sys.executable


def live_processes(session: int) -> list[int]:
    """Processes of a session (``start_new_session=True``: its id is the leader's pid), zombies excluded."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            alive.append(int(stat.parent.name))
    return alive


class Session:
    """A command in a new session whose output lines are collected, with arrival times, as they come."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        import threading

        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            cmd,
            env=command_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        """Wait until a line containing ``text`` arrived; kill the session and fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not any(text in line for _, line in self.lines):
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                self.kill()
                raise AssertionError(f"no line with {text!r} within {timeout}s:\n{self.output}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[int, float]:
        """Wait for the command and every process of its session; return its code and when all were gone."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        deadline = time.monotonic() + timeout
        while live_processes(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = time.time()
        self._reader.join(timeout=5)
        if live_processes(self.proc.pid):
            self.kill()
            raise AssertionError(f"processes left behind:\n{self.output}")
        return code, gone

    def kill(self) -> None:
        # os.killpg/os.kill, not the kill command: procps-ng 4.0's `kill -9 -PGID` can signal
        # processes outside the session (it ended the shell that ran the tests)
        for pid in [self.proc.pid, *live_processes(self.proc.pid)]:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
