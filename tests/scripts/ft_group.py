"""One replica group (2 processes, FSDP) of a fault-tolerant job; run once per group.

    python tests/scripts/ft_group.py --group 0 --lighthouse http://host:29510 --out DIR --steps 20

The loop is the ordinary Accelerator loop; it stops at a number of *committed* steps (a group that
rejoins takes the live groups' count). Every step is recorded in ``DIR/g{group}r{rank}.jsonl``: each
attempt's samples before its backward, then whether it committed and how many groups took part, and at the end the
full weights go to ``DIR/g{group}r{rank}.pt``, so a test can replay the run in one process.
``DIR/go`` must exist before the first step; with ``--hold-at S`` the group waits at step S until
``DIR/release`` exists (so a test can restart a group while this one is still training).
``--precision 16-mixed --overflow-at S`` makes the gradients of step S overflow (the scaler skips it
and halves its scale); ``--scheduler`` passes an LR scheduler to ``acc.setup``; each record then
carries the scale and the learning rate.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from minifabric import Accelerator, FaultTolerance, FSDPStrategy

NUM_SAMPLES, IN, OUT = 64, 8, 4


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, indexed by sample (the same in every process)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(NUM_SAMPLES, IN, generator=g), torch.randn(NUM_SAMPLES, OUT, generator=g)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 16), Block(16), Block(16), nn.Linear(16, OUT))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--pace", type=float, default=0.05)
    parser.add_argument("--overlap-quorum", action="store_true")
    parser.add_argument("--min-groups", type=int, default=1)
    parser.add_argument("--quorum-timeout", type=float, default=60)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--overflow-at", type=int, default=None)
    parser.add_argument("--scheduler", action="store_true")
    args = parser.parse_args()

    ft = FaultTolerance(
        replica_group_id=args.group,
        num_replica_groups=2,
        lighthouse=args.lighthouse,
        timeout=30,
        overlap_quorum=args.overlap_quorum,
        min_replica_groups=args.min_groups,
        quorum_timeout=args.quorum_timeout,
    )
    strategy = FSDPStrategy(fault_tolerance=ft)
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2, precision=args.precision)
    acc.launch()
    model = build_model()
    optimizer = build_optimizer(model)
    scheduler = None
    if args.scheduler:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        model, optimizer, scheduler = acc.setup(model, optimizer, scheduler=scheduler)
    else:
        model, optimizer = acc.setup(model, optimizer)
    scaler = getattr(acc.precision, "scaler", None)
    x_all, y_all = data()
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(NUM_SAMPLES)), batch_size=2))
    group = acc.strategy.replica_group
    tag = f"g{args.group}r{acc.global_rank}"
    print(f"{tag} ready", flush=True)
    wait_for(args.out / "go")

    log = (args.out / f"{tag}.jsonl").open("a")
    held = False
    while group.step < args.steps:
        for (index,) in loader:
            if group.step >= args.steps:
                break
            if args.hold_at is not None and group.step == args.hold_at and not held:
                held = True
                print(f"{tag} holding at step {group.step}", flush=True)
                wait_for(args.out / "release")
            loss = nn.functional.mse_loss(model(x_all[index]), y_all[index])
            if args.overflow_at is not None and group.step == args.overflow_at:
                loss = loss * 1e30  # scaled, its gradients overflow float16
            step = group.step  # read after the forward: a group that rejoins has healed by now
            # written before backward: if this group dies after its gradients reached the others,
            # a replay still knows which samples they came from
            log.write(json.dumps({"attempt": step, "indices": index.tolist()}) + "\n")
            log.flush()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
            record = {
                "step": step,
                "committed": group.step == step + 1,
                "participants": group.num_participants,
                "contributed": group.contributed,
                "indices": index.tolist(),
                "healed_at": group.healed_at,
                "lr": optimizer.param_groups[0]["lr"],
                "scheduler": scheduler.last_epoch if scheduler is not None else None,
                "scale": scaler.get_scale() if scaler is not None else None,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"{tag} step {group.step} participants {group.num_participants}", flush=True)
            time.sleep(args.pace)

    acc.save(args.out / "ckpt", {"model": model, "optimizer": optimizer, "replicas": group})
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    torch.save(full, args.out / f"{tag}.pt")
    print(f"{tag} done at step {group.step} wrote_checkpoint={group.writes_checkpoints}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
