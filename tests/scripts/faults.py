"""A run in which one rank meets a fault at one step, for tests/distributed/test_faults.py.

    python tests/scripts/faults.py FAULT RANK STEP STRATEGY OUT_DIR [DEVICES]

Every rank trains a tiny model, saves a checkpoint at step 2 (committed), and prints
``STEP n rank=R`` after each step. At step STEP, rank RANK prints ``FAULT at=<time>`` and meets
FAULT: ``sigkill``, ``sigterm``, ``sigint``, ``sigsegv``, ``sigabrt``, ``sigstop`` (a real signal
to itself), ``gil`` (a C call that never returns while holding the GIL), ``thread`` (an exception
in a thread it started), ``oom`` (a ``MemoryError`` from a real allocation), ``disk`` (the disk
fills up during a save: a file size limit makes the write fail). The loop never reads
``acc.should_stop``, so SIGTERM ends the rank (a preemption read by the loop is a clean stop,
tested elsewhere). Started by ``acc.launch()`` (DEVICES processes), ``minifabric run`` or torchrun.
"""

import ctypes
import os
import resource
import signal
import sys
import threading
import time

import torch

from minifabric import Accelerator


def inject(fault: str, acc: Accelerator, state: dict, out_dir: str) -> None:
    print(f"FAULT at={time.time():.3f} rank={acc.global_rank} pid={os.getpid()}", flush=True)
    signals = {
        "sigkill": signal.SIGKILL,
        "sigterm": signal.SIGTERM,
        "sigint": signal.SIGINT,
        "sigsegv": signal.SIGSEGV,
        "sigabrt": signal.SIGABRT,
        "sigstop": signal.SIGSTOP,
    }
    if fault in signals:
        os.kill(os.getpid(), signals[fault])
    elif fault == "gil":
        ctypes.PyDLL(None).sleep(1_000_000)  # PyDLL keeps the GIL during the call
    elif fault == "thread":

        def work() -> None:
            raise RuntimeError("planned failure in a background thread")

        threading.Thread(target=work, name="user-worker").start()
        time.sleep(30)
    elif fault == "oom":
        bytearray(1 << 62)  # MemoryError: the allocation fails
    elif fault == "disk":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def main() -> None:
    fault, rank, at_step, strategy, out_dir = sys.argv[1:6]
    devices = "auto" if "WORLD_SIZE" in os.environ else int(sys.argv[6])
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=devices)
    acc.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    ckpt = os.path.join(out_dir, "ckpt")
    for step in range(1, 200):
        acc.backward(model(torch.randn(8, 64)).sum())
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model, "optimizer": optimizer, "step": step}
        if step == int(at_step) and acc.global_rank == int(rank):
            inject(fault, acc, state, out_dir)
        if step == 2 or (fault == "disk" and step == int(at_step)):
            acc.save(ckpt, state)
        print(f"STEP {step} rank={acc.global_rank}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
