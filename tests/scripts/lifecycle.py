"""Two ranks that end in a chosen way, for the lifecycle tests (tests/distributed/test_lifecycle.py).

    python tests/scripts/lifecycle.py MODE [--spawn]

Modes: ``exit`` (rank 0 calls ``sys.exit(3)`` while rank 1 waits in a collective), ``first`` (rank 0
raises inside ``acc.rank_zero_first()``), ``spin`` (rank 1 loops in Python while rank 0 waits in
``all_reduce``), ``loop`` (both train until ``acc.should_stop``, saving a checkpoint at step 2),
``train`` (as ``loop`` but never reading ``should_stop``), ``big`` (with
``--spawn``: ``launch(fn)`` returns 1 MB), ``busy-R`` (inside ``acc.rank_zero_first()``, rank R
holds the GIL in one C call that computes for three heartbeat timeouts, as unpickling a large
dataset does, then every rank trains three steps and ends; ``busy-both``: both ranks at once), ``late`` (rank 1 ends 3 s after rank 0's
process has ended: rank 0 waits for it at exit only so long). Every rank prints ``PID rank=R pid=P`` once it has
joined, ``STEP n`` after each step and ``DONE rank=R`` at a good end.
"""

import itertools
import os
import sys
import time

import torch

from minifabric import Accelerator


def hold_gil(seconds: float) -> float:
    """Hold the GIL in one C call that computes for at least ``seconds``; return how long the longest call took.

    ``sum`` over ``itertools.repeat`` runs in C from start to end, never back in the interpreter
    loop, so no other thread of this process runs Python meanwhile. The count is scaled until one
    call lasts long enough on this machine, however loaded.
    """
    count = 1_000_000
    while True:
        start = time.perf_counter()
        sum(itertools.repeat(1, count))
        took = time.perf_counter() - start
        if took >= seconds:
            return took
        count = int(count * max(2.0, 1.5 * seconds / max(took, 1e-3)))


def wait_for_end(pid: int, seconds: float) -> None:
    """Wait until process ``pid`` (of this host) has ended, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except OSError:
            return
        time.sleep(0.1)
    raise SystemExit(f"process {pid} did not end within {seconds}s")


def run(acc: Accelerator, mode: str, out_dir: str) -> bytes | None:
    print(f"PID rank={acc.global_rank} pid={os.getpid()}", flush=True)
    pids = [0] * acc.world_size
    torch.distributed.all_gather_object(pids, os.getpid())
    if mode == "big":
        return b"x" * (1 << 20)
    if mode == "first":
        with acc.rank_zero_first():
            if acc.global_rank == 0:
                time.sleep(0.5)
                print(f"FAILING at={time.time():.3f}", flush=True)
                raise RuntimeError("planned failure while preparing data")
        time.sleep(60)  # never reached on any rank
    if mode.startswith("busy-"):
        timeout = float(os.environ["MINIFABRIC_HEARTBEAT_TIMEOUT"])
        if mode == "busy-both":
            print(f"HELD {hold_gil(3 * timeout):.1f}s rank={acc.global_rank}", flush=True)
        with acc.rank_zero_first():
            if mode == f"busy-{acc.global_rank}":
                print(f"HELD {hold_gil(3 * timeout):.1f}s rank={acc.global_rank}", flush=True)
        mode = "steps"
    if mode == "spin":
        if acc.global_rank == 1:
            print(f"FAILING at={time.time():.3f}", flush=True)
            while True:  # a rank that never joins the collective
                pass
        acc.all_reduce(torch.ones(1))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    step = 0
    while mode in ("train", "steps", "late") or not acc.should_stop:  # "train" never asks: signals end it
        acc.backward(model(torch.randn(8, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        print(f"STEP {step} rank={acc.global_rank}", flush=True)
        if step == 2:
            acc.save(os.path.join(out_dir, "ckpt"), {"model": model, "step": step})
        if mode == "exit" and step == 3 and acc.global_rank == 0:
            print(f"FAILING at={time.time():.3f}", flush=True)
            sys.exit(3)
        if mode in ("steps", "late") and step == 3:
            break
        time.sleep(0.05)
    else:
        print(f"STOPPED at step {step} rank={acc.global_rank}", flush=True)
        return None
    if mode == "late" and acc.global_rank == 1:
        wait_for_end(pids[0], seconds=120)
        time.sleep(3)  # the heartbeat threads of this rank run on meanwhile
    print(f"DONE rank={acc.global_rank}", flush=True)
    return None


if __name__ == "__main__":
    mode = sys.argv[1]
    out_dir = os.environ.get("LIFECYCLE_OUT", ".")
    acc = Accelerator(accelerator="cpu", devices=2)
    if "--spawn" in sys.argv:
        result = acc.launch(run, mode, out_dir)
        print(f"RESULT {len(result) if result is not None else None}", flush=True)
    else:
        acc.launch()
        run(acc, mode, out_dir)
