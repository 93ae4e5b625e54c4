"""Two ranks that end in a chosen way, for the lifecycle tests (tests/distributed/test_lifecycle.py).

    python tests/scripts/lifecycle.py MODE [--spawn]

Modes: ``exit`` (rank 0 calls ``sys.exit(3)`` while rank 1 waits in a collective), ``first`` (rank 0
raises inside ``acc.rank_zero_first()``), ``spin`` (rank 1 loops in Python while rank 0 waits in
``all_reduce``), ``loop`` (both train until ``acc.should_stop``, saving a checkpoint at step 2),
``train`` (as ``loop`` but never reading ``should_stop``), ``big`` (with
``--spawn``: ``launch(fn)`` returns 1 MB). Every rank prints ``PID rank=R pid=P`` once it has
joined, and ``STEP n`` after each step.
"""

import os
import sys
import time

import torch

from minifabric import Accelerator


def run(acc: Accelerator, mode: str, out_dir: str) -> bytes | None:
    print(f"PID rank={acc.global_rank} pid={os.getpid()}", flush=True)
    if mode == "big":
        return b"x" * (1 << 20)
    if mode == "first":
        with acc.rank_zero_first():
            if acc.global_rank == 0:
                time.sleep(0.5)
                print(f"FAILING at={time.time():.3f}", flush=True)
                raise RuntimeError("planned failure while preparing data")
        time.sleep(60)  # never reached on any rank
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
    while mode == "train" or not acc.should_stop:  # "train" never asks: signals end it
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
        time.sleep(0.05)
    print(f"STOPPED at step {step} rank={acc.global_rank}", flush=True)
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
