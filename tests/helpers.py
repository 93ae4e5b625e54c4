"""Run a function on N real processes (gloo, CPU) and collect every rank's result, with a timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
        # Plain pickle copies tensor data into the message: torch's queue pickler would share it
        # through a file descriptor that dies with this process before the parent reads it.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` fresh processes; return results ordered by rank.

    ``fn`` must be defined at module level. Fails (never hangs) if a rank raises, dies or the run
    exceeds ``timeout`` seconds; the failing ranks' tracebacks are in the message.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed run of {fn.__name__} exceeded {timeout}s; finished: {sorted(results)}"
                )
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in errors]
                if dead and len(results) + len(errors) < world_size:
                    # give the queue a moment to deliver the traceback of a rank that failed
                    time.sleep(1.0)
                    while not queue.empty():
                        rank, status, value = queue.get()
                        (results if status == "ok" else errors)[rank] = value
                    if errors:
                        break
                    raise RuntimeError(
                        f"ranks {dead} died without a result (exit codes {[procs[i].exitcode for i in dead]})"
                    ) from None
                continue
            (results if status == "ok" else errors)[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
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
