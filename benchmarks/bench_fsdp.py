"""FSDP benchmarks on 2 CPU processes (gloo): step time, peak memory, meta-device init.

Usage (from the repository root)::

    python benchmarks/bench_fsdp.py step      # minifabric vs hand-written FSDP2 vs Fabric ModelParallelStrategy, ~30M GPT
    python benchmarks/bench_fsdp.py memory    # peak RSS per rank, FSDP vs DDP, ~100M GPT + AdamW, three malloc settings
    python benchmarks/bench_fsdp.py init      # init_module(empty_init=True)+setup vs eager+setup, ~1B GPT
    python benchmarks/bench_fsdp.py init --layers 10   # a smaller model for machines with less memory

Every number is a ratio measured side by side in one run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
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

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss

WORLD_SIZE = 2
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def n_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


# ---- step time -----------------------------------------------------------------------------------

STEP_CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=512)


def _shard_by_hand(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fabric_parallelize(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    return _shard_by_hand(model, device_mesh["data_parallel"])


def _step_worker(rank: int, steps: int, rounds: int) -> dict[str, list[float]]:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    batch = torch.randint(
        0, STEP_CFG.vocab_size, (2, STEP_CFG.block_size + 1), generator=torch.Generator().manual_seed(rank)
    )

    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=WORLD_SIZE)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = GPT(STEP_CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.setup(model, optimizer)

    def minifabric_step() -> None:
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()

    hand = _shard_by_hand(GPT(STEP_CFG), init_device_mesh("cpu", (WORLD_SIZE,)))
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-4)

    def hand_step() -> None:
        gpt_loss(hand, batch).backward()
        hand_opt.step()
        hand_opt.zero_grad()

    strategy = ModelParallelStrategy(
        _fabric_parallelize, data_parallel_size=WORLD_SIZE, tensor_parallel_size=1
    )
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    fabric_model = fabric.setup_module(GPT(STEP_CFG))
    fabric_opt = fabric.setup_optimizers(torch.optim.AdamW(fabric_model.parameters(), lr=1e-4))

    def fabric_step() -> None:
        fabric.backward(gpt_loss(fabric_model, batch))
        fabric_opt.step()
        fabric_opt.zero_grad()

    loops = {"minifabric": minifabric_step, "fsdp2_by_hand": hand_step, "fabric_model_parallel": fabric_step}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for step in loops.values():  # warm-up: optimizer state, allocator pools, gloo buffers
        step()
        step()
    names = list(loops)
    for round_index in range(rounds):
        # interleaved, so machine load hits every loop alike; the order rotates so no loop always goes first
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step = loops[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def bench_step(args: argparse.Namespace) -> None:
    results = run_distributed(
        _step_worker, WORLD_SIZE, args.steps, args.rounds, timeout=1200, start_method="spawn"
    )
    times = results[0]
    print(
        f"GPT {n_params(STEP_CFG) / 1e6:.1f}M params, {WORLD_SIZE} ranks, {args.rounds} rounds x {args.steps} steps"
    )
    for name, values in times.items():
        print(
            f"  {name:24s} median step {statistics.median(values) * 1e3:8.1f} ms  (rounds: {[round(v, 3) for v in values]})"
        )
    for other in ("fsdp2_by_hand", "fabric_model_parallel"):
        # ratio within each round (same machine load), then the median over rounds
        ratios = [a / b for a, b in zip(times["minifabric"], times[other], strict=True)]
        print(
            f"  minifabric / {other:22s} = {statistics.median(ratios):.3f}  (per round: {[round(r, 3) for r in ratios]})"
        )


# ---- peak memory ----------------------------------------------------------------------------------

MEMORY_CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=13, n_head=12, n_embd=768, tied=True)


def _memory_worker(rank: int, strategy: str, steps: int) -> float:
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=WORLD_SIZE)
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = GPT(MEMORY_CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.setup(model, optimizer)
    batch = torch.randint(0, MEMORY_CFG.vocab_size, (2, MEMORY_CFG.block_size + 1))
    for _ in range(steps):
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return peak_rss_mib()


def bench_memory(args: argparse.Namespace) -> None:
    print(f"GPT {n_params(MEMORY_CFG) / 1e6:.1f}M params + AdamW, {WORLD_SIZE} ranks, {args.steps} steps")
    configurations = (
        ("minifabric default", {}),
        ("glibc malloc defaults", {"MINIFABRIC_TUNE_MALLOC": "0"}),
        ("MALLOC_*_THRESHOLD_=131072", TUNED_MALLOC),
    )
    for label, env in configurations:
        saved = dict(os.environ)
        os.environ.update(env)  # spawned ranks start with it, so glibc reads it at startup
        try:
            peaks = {
                s: run_distributed(
                    _memory_worker, WORLD_SIZE, s, args.steps, timeout=900, start_method="spawn"
                )
                for s in ("fsdp", "ddp")
            }
        finally:
            os.environ.clear()
            os.environ.update(saved)
        fsdp, ddp = max(peaks["fsdp"]), max(peaks["ddp"])
        print(
            f"  {label:28s} peak RSS/rank: fsdp {fsdp:7.0f} MiB, ddp {ddp:7.0f} MiB, fsdp/ddp = {fsdp / ddp:.3f}"
        )


# ---- meta-device init -----------------------------------------------------------------------------


def _init_worker(rank: int, cfg: GPTConfig, empty_init: bool) -> tuple[float, float, float, float]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=WORLD_SIZE)
    acc.launch()
    torch.empty(2, device="meta").normal_()  # one-time imports a random op on meta triggers (torch._dynamo)
    dist.barrier()
    start = time.perf_counter()
    torch.manual_seed(0)
    with acc.init_module(empty_init=empty_init):
        model = GPT(cfg)
    built = time.perf_counter()
    acc.setup(model)
    dist.barrier()
    end = time.perf_counter()
    return end - start, peak_rss_mib(), built - start, end - built


def bench_init(args: argparse.Namespace) -> None:
    """Meta init + setup against eager construction + setup, side by side, ``--rounds`` times.

    Where the time goes: both paths draw every random number of the init once (the meta path on
    scratch tensors at construction, keeping each rank's shard; ``setup`` then only copies it).
    Eager construction also allocates and fills the whole model, and its ``setup`` copies each
    rank's shard out of it; the meta path allocates one full-size scratch tensor at a time and its
    ``setup`` allocates only the shards. The remaining meta time is the random number generation
    (the same work as eager) plus recording (a meta run per op, a few ms per parameter).
    """
    cfg = GPTConfig(vocab_size=8192, block_size=64, n_layer=args.layers, n_head=16, n_embd=2048, tied=True)
    print(f"GPT {n_params(cfg) / 1e9:.2f}B params, {WORLD_SIZE} ranks, setup with FSDP, {args.rounds} rounds")
    walls: dict[bool, list[float]] = {True: [], False: []}
    rss: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for empty in (True, False):
            res = run_distributed(_init_worker, WORLD_SIZE, cfg, empty, timeout=1200, start_method="spawn")
            walls[empty].append(max(r[0] for r in res))
            rss[empty].append(max(r[1] for r in res))
            label = "init_module(empty_init=True)" if empty else "eager (empty_init=False)"
            print(
                f"  {label:30s} wall {walls[empty][-1]:6.1f} s (construction {max(r[2] for r in res):5.1f} s,"
                f" setup {max(r[3] for r in res):5.1f} s)  peak RSS/rank {rss[empty][-1]:7.0f} MiB",
                flush=True,
            )
    wall_ratio = statistics.median(walls[True]) / statistics.median(walls[False])
    rss_ratio = statistics.median(rss[True]) / statistics.median(rss[False])
    print(f"  median wall time ratio meta/eager = {wall_ratio:.3f} (target <= 0.8)")
    print(f"  median peak RSS ratio meta/eager = {rss_ratio:.3f} (target <= 0.4)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    step = sub.add_parser("step")
    step.add_argument("--steps", type=int, default=2)
    step.add_argument("--rounds", type=int, default=5)
    memory = sub.add_parser("memory")
    memory.add_argument("--steps", type=int, default=3)
    init = sub.add_parser("init")
    init.add_argument("--layers", type=int, default=20)
    init.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    {"step": bench_step, "memory": bench_memory, "init": bench_init}[args.bench](args)


if __name__ == "__main__":
    main()
