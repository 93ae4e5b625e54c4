"""How the costs of FSDP training grow with the number of ranks and with the model size (CPU, gloo).

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py ranks            # one ~30M GPT at 1, 2 and 4 ranks
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py sizes            # 25M, 100M, 400M GPTs at 2 ranks
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py ranks --plot benchmarks/scaling.png

For every configuration, fresh processes report per rank:

- ``state``: bytes of this rank's parameters + gradients + optimizer state, counted from the local
  tensors (the local shard of each DTensor). FSDP should divide it by N.
- ``baseline``: resident memory after ``launch()`` and before the model exists (interpreter, torch,
  gloo buffers): constant per process.
- ``activations``: the peak resident memory during a training step minus the resident memory just
  before it (activations, the all-gathered unsharded blocks and gloo's buffers).
- ``peak``: the process's peak resident memory over the whole run.
- step time (median of the timed steps), and the time and the bytes written by this rank to save a
  sharded checkpoint of model + AdamW, and the time to load it back.

Peak memory is ``VmHWM`` (reset through ``/proc/self/clear_refs`` before each step), not
``ru_maxrss``. Absolute times depend on the machine; with 4 ranks on a 2-core machine the ranks share
cores, which this benchmark reports rather than hides.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss

MiB = 1024 * 1024
RANKS_CFG = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=512, tied=True)
SIZE_CFGS = {
    "25M": GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=8, n_embd=512, tied=True),
    "100M": GPTConfig(vocab_size=8192, block_size=64, n_layer=13, n_head=12, n_embd=768, tied=True),
    "400M": GPTConfig(vocab_size=8192, block_size=64, n_layer=24, n_head=16, n_embd=1152, tied=True),
}


def _status(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _worker(rank: int, world: int, cfg: GPTConfig, steps: int, folder: str) -> dict[str, float]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world)
    acc.launch()
    baseline = _status("VmRSS")
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.setup(model, optimizer)
    batch = torch.randint(
        0, cfg.vocab_size, (2, cfg.block_size + 1), generator=torch.Generator().manual_seed(rank)
    )

    def step() -> None:
        acc.backward(gpt_loss(model, batch))
        optimizer.step()

    step()  # optimizer state exists from here on; gradients are kept until the next step
    params = list(model.parameters())
    state = _local_bytes(params) + _local_bytes(p.grad for p in params)
    state += _local_bytes(v for s in optimizer.state.values() for v in s.values())
    optimizer.zero_grad()
    times, activations = [], []
    peak = _status("VmHWM")  # the peak so far (setup, first step): kept across the resets below
    for _ in range(steps):
        dist.barrier()
        before = _status("VmRSS")
        peak = max(peak, _status("VmHWM"))
        _reset_peak()
        start = time.perf_counter()
        step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        activations.append(_status("VmHWM") - before)
    path = Path(folder) / "ckpt"
    dist.barrier()
    start = time.perf_counter()
    acc.save(path, {"model": model, "optimizer": optimizer})
    dist.barrier()
    save_s = time.perf_counter() - start
    written = sum(f.stat().st_size for f in path.rglob(f"__{rank}_*.distcp"))
    start = time.perf_counter()
    acc.load(path, {"model": model, "optimizer": optimizer})
    dist.barrier()
    load_s = time.perf_counter() - start
    peak = max(peak, _status("VmHWM"))
    return {
        "state": state / MiB,
        "baseline": baseline / MiB,
        "activations": statistics.median(activations) / MiB,
        "peak": peak / MiB,
        "step_s": statistics.median(times),
        "save_s": save_s,
        "written": written / MiB,
        "load_s": load_s,
    }


def _n_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def _run(label: str, world: int, cfg: GPTConfig, steps: int) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="bench-scaling-")
    try:
        results = run_distributed(
            _worker, world, world, cfg, steps, folder, timeout=3600, start_method="spawn"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # the largest value over ranks (the rank that sets the job's memory and time)
    row = {key: max(r[key] for r in results) for key in results[0]}
    print(
        f"| {label} | {world} | {row['state']:.0f} | {row['activations']:.0f} | {row['baseline']:.0f} |"
        f" {row['peak']:.0f} | {row['step_s']:.2f} | {row['save_s']:.2f} | {row['written']:.0f} | {row['load_s']:.2f} |",
        flush=True,
    )
    return row


HEADER = (
    "| model | ranks | params+grads+AdamW MiB/rank | activations MiB/rank | baseline MiB/rank | peak RSS MiB/rank"
    " | step s | save s | MiB written/rank | load s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sweep", choices=["ranks", "sizes"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", default=list(SIZE_CFGS))
    parser.add_argument(
        "--plot", type=Path, default=None, help="write a PNG of memory per rank (needs matplotlib)"
    )
    args = parser.parse_args()
    print(HEADER, flush=True)
    if args.sweep == "ranks":
        label = f"GPT {_n_params(RANKS_CFG) / 1e6:.0f}M"
        rows = {w: _run(label, w, RANKS_CFG, args.steps) for w in args.ranks}
        xs, xlabel = list(rows), "ranks"
    else:
        rows = {}
        for name in args.sizes:
            cfg = SIZE_CFGS[name]
            rows[_n_params(cfg) / 1e6] = _run(f"GPT {_n_params(cfg) / 1e6:.0f}M", 2, cfg, args.steps)
        xs, xlabel = list(rows), "parameters (millions), 2 ranks"
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, name in (("state", "params+grads+AdamW"), ("activations", "activations"),
                          ("baseline", "process baseline"), ("peak", "peak RSS")):  # fmt: skip
            ax.plot(xs, [rows[x][key] for x in xs], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MiB per rank")
        ax.set_xticks(xs)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
