"""Pretrain sharded on 2 processes, consolidate to one file, fine-tune it on 1 process.

A sharded checkpoint is a folder with one shard per rank. ``minifabric consolidate`` merges it
into one ordinary file (``torch.load(..., weights_only=True)`` reads it), and ``acc.load_raw``
loads its model into a model set up on any world size and strategy. (``acc.load`` can also read
the sharded folder directly on a different world size; consolidation is for handing weights to
code that knows nothing of minifabric.)

Run the three steps (a few seconds each):

    python examples/finetune_consolidated.py pretrain            # FSDP, 2 processes -> out/finetune/pretrained/
    minifabric consolidate out/finetune/pretrained out/finetune/pretrained.pt
    python examples/finetune_consolidated.py finetune            # 1 process, starts from pretrained.pt
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifabric import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("stage", choices=["pretrain", "finetune"])
parser.add_argument("--out-dir", default="out/finetune")
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def task(x: torch.Tensor, shift: float) -> torch.Tensor:
    """Pretraining learns sin(sum x); fine-tuning learns the same function, shifted."""
    return torch.sin(x.sum(dim=1, keepdim=True)) + shift


if args.stage == "pretrain":
    acc = Accelerator(accelerator="cpu", devices=2, strategy="fsdp")
    shift, lr = 0.0, 1e-2
else:
    acc = Accelerator(accelerator="cpu", devices=1)  # a different world size and strategy
    shift, lr = 0.5, 1e-2
acc.launch()
acc.seed_everything(0)

with acc.init_module(empty_init=args.stage == "pretrain"):
    model = make_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
model, optimizer = acc.setup(model, optimizer)
if args.stage == "finetune":
    acc.load_raw(f"{args.out_dir}/pretrained.pt", model)  # the consolidated file: full tensors

generator = torch.Generator().manual_seed(100 + acc.global_rank)
x_val = 0.3 * torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    acc.print(f"{args.stage}: start val loss {F.mse_loss(model(x_val), task(x_val, shift)).item():.4f}")
for _ in range(args.steps):
    x = 0.3 * torch.randn(64, 8, generator=generator)
    loss = F.mse_loss(model(x), task(x, shift))
    optimizer.zero_grad()
    acc.backward(loss)
    optimizer.step()
with torch.no_grad():
    acc.print(f"{args.stage}: end val loss {F.mse_loss(model(x_val), task(x_val, shift)).item():.4f}")

if args.stage == "pretrain":
    acc.save(f"{args.out_dir}/pretrained", {"model": model, "optimizer": optimizer})  # sharded folder
    acc.print(
        f"saved {args.out_dir}/pretrained; now: minifabric consolidate {args.out_dir}/pretrained {args.out_dir}/pretrained.pt"
    )
