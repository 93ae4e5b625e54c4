"""Step time of a tiny 2-rank DDP loop: minifabric vs plain torch DDP, in the same processes.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python benchmarks/bench_stop.py [--rounds 9] [--steps 200]

Both loops run on the same two gloo ranks, the same model shape and data: minifabric's
``strategy="ddp"`` (``acc.backward``, the wrapped ``optimizer.step()``), and a hand-written
``DistributedDataParallel`` loop over the process group minifabric joined. The loops take turns
step by step (the order alternating), each round keeps the median of each loop's per-step times,
and the result is the median over rounds of minifabric's step time divided by plain DDP's in that
round. A third loop is minifabric reading ``acc.should_stop`` once per step
(the stop agreement: one all-reduce of one integer), to show what the read costs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from minifabric import Accelerator
from tests.helpers import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


def _rank(rank: int, rounds: int, steps: int) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    model = _model()
    model_mf, optimizer_mf = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    plain = DistributedDataParallel(_model())
    optimizer_plain = torch.optim.SGD(plain.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    stops: list[bool] = []

    def minifabric_step() -> None:
        acc.backward(model_mf(x).sum())
        optimizer_mf.step()
        optimizer_mf.zero_grad()

    def minifabric_reading_step() -> None:
        minifabric_step()
        stops.append(acc.should_stop)

    def plain_step() -> None:
        plain(x).sum().backward()
        optimizer_plain.step()
        optimizer_plain.zero_grad()

    loops = {"minifabric": minifabric_step, "plain": plain_step, "reading": minifabric_reading_step}
    for _ in range(50):  # warm-up
        for step in loops.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in loops}
    gc.disable()  # a collection inside one loop only would be charged to that loop
    try:
        for r in range(rounds):
            # The loops take turns step by step, first and second alternating, and each round keeps
            # the median of its per-step times: a burst of load from other jobs on a shared machine
            # then hits every loop alike instead of one loop's whole round.
            per_step: dict[str, list[float]] = {name: [] for name in loops}
            acc.barrier()
            for i in range(steps):
                order = list(loops) if (i + r) % 2 == 0 else ["plain", "minifabric", "reading"]
                for name in order:
                    start = time.perf_counter()
                    loops[name]()
                    per_step[name].append(time.perf_counter() - start)
            for name in loops:
                times[name].append(statistics.median(per_step[name]))
            gc.collect()
    finally:
        gc.enable()
    return {"times": times, "stopped": any(stops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = run_distributed(_rank, 2, args.rounds, args.steps, timeout=600)
    times = results[0]["times"]
    ratios = [m / p for m, p in zip(times["minifabric"], times["plain"], strict=True)]
    reading = [m / p for m, p in zip(times["reading"], times["plain"], strict=True)]
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"median step time (rank 0): minifabric {ms['minifabric']:.3f} ms, plain DDP {ms['plain']:.3f} ms,"
          f" minifabric reading should_stop every step {ms['reading']:.3f} ms")  # fmt: skip
    print(f"minifabric / plain DDP, should_stop never read: median {statistics.median(ratios):.3f}"
          f" (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    print(f"minifabric reading should_stop every step / plain DDP: median {statistics.median(reading):.3f}"
          f" (rounds: {', '.join(f'{r:.2f}' for r in reading)})")  # fmt: skip


if __name__ == "__main__":
    main()
