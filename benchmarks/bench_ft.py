"""Step time with per-step fault tolerance (torchft) on vs off: 2 replica groups x 2 FSDP ranks, CPU/gloo.

Usage (from the repository root; needs ``pip install 'minifabric[ft]'``)::

    python benchmarks/bench_ft.py                 # 3 alternating runs of each, ~8M-parameter MLP
    python benchmarks/bench_ft.py --repeats 5 --width 512
    python benchmarks/bench_ft.py --overlap-quorum    # also "overlap": FaultTolerance(overlap_quorum=True)

*off* is native HSDP on one 4-process job: ``FSDPStrategy(sharding_strategy="HYBRID_SHARD",
device_mesh=(2, 2))`` (shard over 2 ranks, all-reduce over the 2 replicas). *on* is the same layout
as two 2-process jobs joined by torchft: ``FSDPStrategy(fault_tolerance=FaultTolerance(...))`` and a
lighthouse started here. Both do the same arithmetic per step. The runs alternate (off, on, off,
on, ...) so that load from other programs hits both alike; each run reports the median step time
of rank 0 after warm-up, and the result is the median over runs and the ratio on/off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---- one run (a rank) --------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from minifabric import Accelerator, FaultTolerance, FSDPStrategy

    if args.mode == "on":
        ft = FaultTolerance(
            replica_group_id=args.group,
            num_replica_groups=2,
            lighthouse=args.lighthouse,
            overlap_quorum=args.overlap_quorum,
        )
        strategy = FSDPStrategy(fault_tolerance=ft)
        devices = 2
    else:
        strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
        devices = 4
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=devices)
    acc.launch()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)]
    model = nn.Sequential(*blocks)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.batch, args.width)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    if acc.global_rank == 0 and args.group == 0:
        Path(args.result).write_text(json.dumps(times[args.warmup :]))


# ---- the driver --------------------------------------------------------------------------------


def _spawn(
    args: argparse.Namespace, mode: str, result: Path, group: int = 0, lighthouse: str = ""
) -> subprocess.Popen:
    args = argparse.Namespace(**{**vars(args), "overlap_quorum": mode == "overlap"})
    mode = "on" if mode == "overlap" else mode
    command = [sys.executable, __file__, "--worker", "--mode", mode, "--result", str(result)]
    command += ["--group", str(group), "--lighthouse", lighthouse]
    for name in ("width", "layers", "batch", "steps", "warmup"):
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--overlap-quorum"] if args.overlap_quorum else []  # a worker of the "overlap" runs
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
    env.pop("MASTER_PORT", None)
    return subprocess.Popen(command, env=env, start_new_session=True)


def _run(args: argparse.Namespace, mode: str, result: Path) -> float:
    processes = []
    lighthouse = None
    try:
        if mode == "off":
            processes.append(_spawn(args, "off", result))
        else:
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
            processes += [_spawn(args, mode, result, g, lighthouse.address()) for g in range(2)]
        for process in processes:
            if process.wait(timeout=900) != 0:
                raise RuntimeError(f"the {mode!r} run failed (exit {process.returncode})")
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
        if lighthouse is not None:
            lighthouse.shutdown()
    return statistics.median(json.loads(result.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--overlap-quorum",
        action="store_true",
        help='also time "overlap" (FaultTolerance(overlap_quorum=True)) in every repeat',
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args)
        return
    os.environ["RUST_LOG"] = "error"  # read when torchft is first imported
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"MLP {args.layers} x {args.width} ({params / 1e6:.1f}M parameters), AdamW, batch {args.batch} per rank"
    )
    print("2 replica groups x 2 FSDP ranks; off = native HSDP (2, 2), on = FaultTolerance over torchft")
    modes = ("off", "on", "overlap") if args.overlap_quorum else ("off", "on")
    if args.overlap_quorum:
        print("overlap = on with FaultTolerance(overlap_quorum=True)")
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_ft_{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            step = _run(args, mode, scratch / f"{mode}{repeat}.json")
            medians[mode].append(step)
            print(f"run {repeat + 1} {mode:>7}: median step {step * 1000:7.1f} ms", flush=True)
    off = statistics.median(medians["off"])
    for mode in modes[1:]:
        on = statistics.median(medians[mode])
        ratios = [b / a for a, b in zip(medians["off"], medians[mode], strict=True)]
        print(f"median step: off {off * 1000:.1f} ms, {mode} {on * 1000:.1f} ms, {mode}/off {on / off:.3f}")
        print(f"{mode}/off per run: " + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
