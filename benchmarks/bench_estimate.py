"""The memory estimator against real runs: estimated per-rank peak vs measured peak RSS above baseline.

Usage (from the repository root)::

    python benchmarks/bench_estimate.py             # 5 configurations of a ~28M-parameter GPT + AdamW
    python benchmarks/bench_estimate.py --only fsdp-2

Each configuration runs in fresh processes (spawn) with glibc's ``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=131072``, so memory freed by the step goes back to the OS and RSS follows
what is allocated. Each rank first runs the same steps on a tiny model (so the code they run is
paged in), then records its RSS (the baseline: the interpreter, torch, gloo, that code) and its peak RSS (``ru_maxrss``) after 3 training steps; the measured
number is the largest rank's peak minus its baseline. FSDP models are built with
``init_module(empty_init=True)``, so no rank ever holds the whole model.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from minifabric import Accelerator, FSDPStrategy, estimate_memory
from tests.helpers import run_distributed
from tests.models import GPT, Block, GPTConfig, gpt_loss

TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
MODEL = {"vocab_size": 8192, "block_size": 256, "n_layer": 6, "n_head": 8, "n_embd": 512, "tied": False}
BATCH = (4, 256)  # per rank: 4 sequences of 256 tokens
STEPS = 3
Config = tuple[str, int, bool]  # strategy, world size, activation checkpointing
CONFIGS: dict[str, Config] = {
    "single": ("single", 1, False),
    "ddp-2": ("ddp", 2, False),
    "fsdp-2": ("fsdp", 2, False),
    "fsdp-2-ac": ("fsdp", 2, True),
    "fsdp-4": ("fsdp", 4, False),
}


def make_gpt(**kwargs: Any) -> GPT:
    """The model factory the estimator and the real runs share."""
    return GPT(GPTConfig(**kwargs))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(
    rank: int, strategy: str, world_size: int, checkpointing: bool, model_kwargs: dict, batch_shape: tuple
) -> tuple[int, int]:
    if strategy == "fsdp":
        policy = {Block} if checkpointing else None
        strategy_obj: Any = FSDPStrategy(activation_checkpointing_policy=policy)
    else:
        strategy_obj = strategy
    acc = Accelerator(accelerator="cpu", strategy=strategy_obj, devices=world_size)
    acc.launch()
    # the same steps on a tiny model first: the code they run is paged in before the baseline (a
    # CUDA build of torch pages in ~75 MiB more of it than a CPU build), so the peak above it counts
    # tensors and allocator, what the estimator estimates
    tiny = {**model_kwargs, "vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32}
    _train(acc, strategy, tiny, torch.randint(0, 64, (batch_shape[0], batch_shape[1] + 1)))
    batch = torch.randint(0, model_kwargs["vocab_size"], (batch_shape[0], batch_shape[1] + 1))
    gc.collect()
    baseline = _rss_bytes()
    _train(acc, strategy, model_kwargs, batch)
    return baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _train(acc: Accelerator, strategy: str, model_kwargs: dict, batch: torch.Tensor) -> None:
    torch.manual_seed(0)
    with acc.init_module(empty_init=strategy == "fsdp"):
        model = make_gpt(**model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.setup(model, optimizer)
    for _ in range(STEPS):
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()


def measure(config: Config, model_kwargs: dict = MODEL, batch_shape: tuple = BATCH) -> int:
    """Largest rank's peak RSS above its baseline, in bytes (fresh processes, tuned malloc)."""
    strategy, world_size, checkpointing = config
    saved = dict(os.environ)
    os.environ.update(TUNED_MALLOC)  # spawned ranks start with it: glibc reads it at startup
    try:
        results = run_distributed(
            _worker,
            world_size,
            strategy,
            world_size,
            checkpointing,
            model_kwargs,
            batch_shape,
            timeout=1200,
            start_method="spawn",
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return max(peak - baseline for baseline, peak in results)


def estimate(config: Config, model_kwargs: dict = MODEL, batch_shape: tuple = BATCH) -> int:
    """The estimator's per-rank peak for the same run, in bytes."""
    strategy, world_size, checkpointing = config
    return estimate_memory(
        make_gpt,
        model_kwargs=model_kwargs,
        strategy=strategy,  # type: ignore[arg-type]
        world_size=world_size,
        batch_shape=batch_shape,
        activation_checkpointing=checkpointing,
    ).total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=list(CONFIGS), action="append")
    args = parser.parse_args()
    n_params = sum(p.numel() for p in make_gpt(**MODEL).parameters())
    print(f"GPT {n_params / 1e6:.1f}M params, AdamW, fp32, batch {BATCH} per rank, {STEPS} steps")
    print("| configuration | estimated peak/rank | measured peak RSS/rank above baseline | error |")
    print("|---|---|---|---|")
    for name in args.only or list(CONFIGS):
        config = CONFIGS[name]
        est, real = estimate(config), measure(config)
        print(
            f"| {name} | {est / 2**20:.0f} MiB | {real / 2**20:.0f} MiB | {100 * (est - real) / real:+.1f}% |"
        )


if __name__ == "__main__":
    main()
