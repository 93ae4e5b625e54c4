"""Tensor parallel x FSDP benchmarks on 4 CPU processes (gloo): step time and peak memory.

Usage (from the repository root)::

    python benchmarks/bench_tensor_parallel.py step     # ModelParallelStrategy vs a hand-written FSDP2 + TP loop at (2, 2)
    python benchmarks/bench_tensor_parallel.py memory   # peak RSS per rank at (dp, tp) = (2, 2) vs (4, 1)
    python benchmarks/bench_tensor_parallel.py estimate # estimate_memory(strategy="model_parallel") vs measured at (2, 2)

Memory is measured in fresh processes (spawn) with ``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=131072``, so freed memory returns to the OS and RSS follows what is
allocated; "above baseline" subtracts each rank's RSS after joining the process group.

The step ratio is measured side by side in one run (same ranks, interleaved rounds); absolute
times depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from minifabric import Accelerator, ModelParallelStrategy, estimate_memory
from tests.helpers import run_distributed
from tests.tp_models import TPBlock, TPConfig, TPTransformer, parallelize, tp_loss

WORLD_SIZE = 4
STEP_CFG = TPConfig(vocab_size=2048, seq_len=64, dim=256, n_head=8, hidden=1024, n_layer=4)
MEMORY_CFG = TPConfig(vocab_size=8192, seq_len=64, dim=768, n_head=12, hidden=3072, n_layer=6)
MEMORY_BATCH = (4, 64)  # per data-parallel group
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def make_model(**kwargs: Any) -> TPTransformer:
    """The factory the estimator and the real runs share."""
    return TPTransformer(TPConfig(**kwargs))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def n_params(cfg: TPConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TPTransformer(cfg).parameters())


def _by_hand(cfg: TPConfig, dp: int, tp: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """What a user writes without the strategy: 2-D mesh, the plan, fully_shard per block then root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = parallelize(TPTransformer(cfg), mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _with_strategy(cfg: TPConfig, dp: int, tp: int) -> tuple[Accelerator, Any, Any]:
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=tp)
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=WORLD_SIZE)
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = TPTransformer(cfg)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return acc, model, optimizer


def _step_worker(rank: int, steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    acc, model, optimizer = _with_strategy(STEP_CFG, 2, 2)
    group = acc.strategy.device_mesh["data_parallel"].get_local_rank()
    batch = torch.randint(
        0, STEP_CFG.vocab_size, (4, STEP_CFG.seq_len + 1), generator=torch.Generator().manual_seed(group)
    )

    def minifabric_step() -> None:
        acc.backward(tp_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()

    hand, hand_opt = _by_hand(STEP_CFG, 2, 2)
    assert sum(isinstance(m, TPBlock) for m in hand.modules()) == STEP_CFG.n_layer

    def hand_step() -> None:
        tp_loss(hand, batch).backward()
        hand_opt.step()
        hand_opt.zero_grad()

    loops = {"minifabric": minifabric_step, "fsdp2_tp_by_hand": hand_step}
    times: dict[str, list[float]] = {name: [] for name in loops}  # per round: median step time
    cpu: dict[str, list[float]] = {name: [] for name in loops}  # per round: this rank's median CPU time
    for step in loops.values():  # warm-up: optimizer state, allocator pools, gloo buffers
        step()
        step()
    names = list(loops)
    for _ in range(rounds):
        wall_steps: dict[str, list[float]] = {name: [] for name in loops}
        cpu_steps: dict[str, list[float]] = {name: [] for name in loops}
        for i in range(steps):
            # the loops take turns step by step (the order alternating), so load drift hits both alike
            for name in names if i % 2 == 0 else names[::-1]:
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                loops[name]()
                cpu_steps[name].append(time.process_time() - start_cpu)
                dist.barrier()
                wall_steps[name].append(time.perf_counter() - start)
        for name in loops:
            times[name].append(statistics.median(wall_steps[name]))
            cpu[name].append(statistics.median(cpu_steps[name]))
    return {"wall": times, "cpu": cpu}


def bench_step(args: argparse.Namespace) -> None:
    results = run_distributed(
        _step_worker, WORLD_SIZE, args.steps, args.rounds, timeout=1800, start_method="spawn"
    )
    print(
        f"TPTransformer {n_params(STEP_CFG) / 1e6:.1f}M params, (dp, tp) = (2, 2),"
        f" {args.rounds} rounds x {args.steps} steps"
    )
    times = results[0]["wall"]
    for name, values in times.items():
        print(
            f"  {name:18s} median step {statistics.median(values) * 1e3:8.1f} ms  (rounds: {[round(v, 3) for v in values]})"
        )
    ratios = [a / b for a, b in zip(times["minifabric"], times["fsdp2_tp_by_hand"], strict=True)]
    print(
        f"  wall: minifabric / fsdp2_tp_by_hand = {statistics.median(ratios):.3f}  (per round: {[round(r, 3) for r in ratios]})"
    )
    # CPU time summed over the ranks: what each loop costs, less exposed to other jobs' load
    mine = [sum(r["cpu"]["minifabric"][i] for r in results) for i in range(args.rounds)]
    hand = [sum(r["cpu"]["fsdp2_tp_by_hand"][i] for r in results) for i in range(args.rounds)]
    ratios = [a / b for a, b in zip(mine, hand, strict=True)]
    print(
        f"  cpu:  minifabric / fsdp2_tp_by_hand = {statistics.median(ratios):.3f}  (per round: {[round(r, 3) for r in ratios]})"
    )


def _memory_worker(rank: int, dp: int, tp: int, steps: int) -> tuple[int, int]:
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=dp, tensor_parallel_size=tp)
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=WORLD_SIZE)
    acc.launch()
    batch = torch.randint(0, MEMORY_CFG.vocab_size, (MEMORY_BATCH[0], MEMORY_BATCH[1] + 1))
    gc.collect()
    baseline = _rss_bytes()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = TPTransformer(MEMORY_CFG)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    for _ in range(steps):
        acc.backward(tp_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(dp: int, tp: int, steps: int) -> list[tuple[int, int]]:
    """Every rank's (baseline, peak) RSS in bytes (fresh processes, tuned malloc)."""
    saved = dict(os.environ)
    os.environ.update(TUNED_MALLOC)  # spawned ranks start with it: glibc reads it at startup
    try:
        return run_distributed(_memory_worker, WORLD_SIZE, dp, tp, steps, timeout=1200, start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def bench_memory(args: argparse.Namespace) -> None:
    print(
        f"TPTransformer {n_params(MEMORY_CFG) / 1e6:.1f}M params + AdamW, {WORLD_SIZE} ranks, {args.steps} steps"
    )
    for dp, tp in ((2, 2), (4, 1)):
        results = measure(dp, tp, args.steps)
        peaks = [peak / 2**20 for _, peak in results]
        above = [(peak - base) / 2**20 for base, peak in results]
        print(
            f"  (dp, tp) = ({dp}, {tp}): peak RSS per rank {[round(p) for p in peaks]} MiB (max {max(peaks):.0f}),"
            f" above baseline {[round(a) for a in above]} MiB (max {max(above):.0f})"
        )


def bench_estimate(args: argparse.Namespace) -> None:
    kwargs = {
        k: getattr(MEMORY_CFG, k) for k in ("vocab_size", "seq_len", "dim", "n_head", "hidden", "n_layer")
    }
    for dp, tp in ((2, 2), (4, 1)):
        start = time.perf_counter()
        est = estimate_memory(
            make_model,
            model_kwargs=kwargs,
            strategy="model_parallel",
            world_size=WORLD_SIZE,
            tensor_parallel_size=tp,
            parallelize_fn=parallelize,
            batch_shape=MEMORY_BATCH,
        )
        seconds = time.perf_counter() - start
        real = max(peak - base for base, peak in measure(dp, tp, args.steps))
        print(
            f"| ({dp}, {tp}) | {est.total / 2**20:.0f} MiB | {real / 2**20:.0f} MiB |"
            f" {100 * (est.total - real) / real:+.1f}% | estimate took {seconds:.0f} s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    step = sub.add_parser("step", help="step time: strategy vs hand-written FSDP2 + TP")
    step.add_argument("--steps", type=int, default=6, help="steps of each loop per round (default: 6)")
    step.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    memory = sub.add_parser("memory", help="peak RSS per rank at (2, 2) and (4, 1)")
    memory.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    estimate = sub.add_parser("estimate", help="estimate_memory vs measured peak above baseline")
    estimate.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    args = parser.parse_args()
    {"step": bench_step, "memory": bench_memory, "estimate": bench_estimate}[args.what](args)


if __name__ == "__main__":
    main()
