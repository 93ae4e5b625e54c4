"""A tiny data-parallel training script, started by the launch tests in several ways.

    python tests/scripts/train.py --devices 2
    minifabric run --devices 2 tests/scripts/train.py
    torchrun --nproc-per-node 2 tests/scripts/train.py --devices 2
    python tests/scripts/train.py --devices 2 --spawn     # acc.launch(fn)

Prints one ``RESULT rank=R world=W ...`` line per rank. With ``--fail-rank R --fail-step S`` rank R
prints ``FAILING at=<unix time>`` and raises at step S, for the fail-fast tests.
"""

import argparse
import time

import torch

from minifabric import Accelerator


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--spawn", action="store_true", help="start the ranks with acc.launch(fn)")
    args = parser.parse_args()
    args.devices = int(args.devices) if args.devices.isdigit() else args.devices
    return args


def train(acc: Accelerator, args: argparse.Namespace) -> tuple[float, float]:
    """Train a few steps on per-rank random data; return the final loss and a parameter checksum."""
    acc.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    torch.manual_seed(acc.global_rank)  # each rank its own data
    for step in range(args.steps):
        if acc.global_rank == args.fail_rank and step == args.fail_step:
            print(f"FAILING at={time.time():.3f}", flush=True)
            raise RuntimeError(f"planned failure at step {step}")
        loss = model(torch.randn(8, 4, device=acc.device)).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return float(loss.detach()), checksum


def run(acc: Accelerator, args: argparse.Namespace) -> None:
    """Train and print this rank's result line."""
    _, checksum = train(acc, args)
    print(
        f"RESULT rank={acc.global_rank} world={acc.world_size} node={acc.node_rank} params={checksum:.10f}",
        flush=True,
    )


def main() -> None:
    args = parse()
    acc = Accelerator(accelerator="cpu", devices=args.devices)
    if args.spawn:
        acc.launch(run, args)
    else:
        acc.launch()
        run(acc, args)


if __name__ == "__main__":
    main()
