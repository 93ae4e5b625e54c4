"""torch.compile under FSDP on 2 CPU processes (gloo): step time and cold-start compile time.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py cold   # first step of each mode, fresh processes
    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py step   # step time, the modes interleaved

``cold`` runs each mode in fresh processes with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``
in a new temporary folder), so the first step pays the whole compile. ``step`` builds all three
models in the same two processes and times one step of each per round, rotating the order (this
machine's speed drifts too much between separate runs to compare them). The modes:

- ``eager``: ``FSDPStrategy()``.
- ``per-block``: ``FSDPStrategy(compile=True)``: each block is compiled before ``fully_shard``
  (what minifabric does, also for ``acc.setup(torch.compile(model))``).
- ``whole-model``: a hand-written FSDP2 loop (``fully_shard`` per block, then root) and
  ``torch.compile`` of the whole sharded model.

The model is ~34M parameters (8 blocks, d=512, vocab 8192), fp32, AdamW, a batch of 2 x 64 tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from minifabric import Accelerator, FSDPStrategy
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss

WORLD_SIZE = 2
CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=512, tied=False)
MODES = ("eager", "per-block", "whole-model")


def _model_and_step(
    mode: str, rank: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Accelerator | None]:
    if mode == "whole-model":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=WORLD_SIZE)
        acc.launch()  # only for the process group
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        torch.manual_seed(0)
        model = GPT(CFG)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4), None
    acc = Accelerator(
        accelerator="cpu", strategy=FSDPStrategy(compile=mode == "per-block"), devices=WORLD_SIZE
    )
    acc.launch()
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.setup(model, optimizer)
    return model, optimizer, acc


def _worker(rank: int, mode: str, steps: int, cache: str) -> tuple[float, list[float]]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    model, optimizer, acc = _model_and_step(mode, rank)
    batch = torch.randint(
        0, CFG.vocab_size, (2, CFG.block_size + 1), generator=torch.Generator().manual_seed(rank)
    )

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        loss = gpt_loss(model, batch)
        acc.backward(loss) if acc is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    first = step()
    step(), step()  # warm-up
    return first, [step() for _ in range(steps)]


def _interleaved_worker(rank: int, rounds: int, cache: str) -> dict[str, list[float]]:
    """All three models in the same two processes; each round times one step of each, order rotated."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=WORLD_SIZE)
    acc.launch()
    models = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPT(CFG)
        if mode == "whole-model":
            for block in model.blocks:
                fully_shard(block, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
            fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
            models[mode] = (torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4))
            continue
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        models[mode] = acc.setup(torch.compile(model) if mode == "per-block" else model, optimizer)
    batch = torch.randint(
        0, CFG.vocab_size, (2, CFG.block_size + 1), generator=torch.Generator().manual_seed(rank)
    )

    def step(mode: str) -> float:
        model, optimizer = models[mode]
        dist.barrier()
        start = time.perf_counter()
        gpt_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    for mode in MODES:  # compile, then warm up
        step(mode), step(mode), step(mode)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            times[mode].append(step(mode))
    return times


def bench_steps(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as cache:
        results = run_distributed(
            _interleaved_worker, WORLD_SIZE, rounds, cache, timeout=2400, start_method="spawn"
        )
    per_round = {mode: [max(t) for t in zip(*(r[mode] for r in results), strict=True)] for mode in MODES}
    print("| mode | median step | median of per-round ratios to eager | per-round ratios |")
    print("|---|---|---|---|")
    for mode in MODES:
        ratios = [t / e for t, e in zip(per_round[mode], per_round["eager"], strict=True)]
        listed = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"| {mode} | {statistics.median(per_round[mode]):.3f} s | {statistics.median(ratios):.2f} | {listed} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("bench", choices=("cold", "step"))
    parser.add_argument("--steps", type=int, default=6, help="cold: timed steps after warm-up")
    parser.add_argument("--rounds", type=int, default=6, help="step: interleaved rounds")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    print(
        f"GPT {sum(p.numel() for p in GPT(CFG).parameters()) / 1e6:.1f}M params, {WORLD_SIZE} ranks, fp32, AdamW"
    )
    if args.bench == "step":
        bench_steps(args.rounds)
        return
    print("| mode | first step (cold compile + step) | median step after warm-up | vs eager |")
    print("|---|---|---|---|")
    eager = None
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as cache:
            results = run_distributed(
                _worker, WORLD_SIZE, mode, args.steps, cache, timeout=1800, start_method="spawn"
            )
        first = max(r[0] for r in results)
        median = statistics.median(max(times) for times in zip(*(r[1] for r in results), strict=True))
        eager = median if mode == "eager" else eager
        ratio = f"{median / eager:.2f}" if eager else "-"
        print(f"| {mode} | {first:.1f} s | {median:.3f} s | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
