"""Manual FSDP wrapping with `wrap` plus activation checkpointing: you decide what becomes a shard unit.

With ``FSDPStrategy()`` and no ``auto_wrap_policy`` minifabric finds the repeated blocks itself
(examples/gpt/train.py). Here the model calls ``wrap(...)`` on the parts it wants sharded as
their own unit; ``wrap`` is a no-op under any other strategy, so the same model code runs on one
device, under DDP and under FSDP. ``activation_checkpointing_policy={Block}`` recomputes each
block's activations in backward instead of keeping them.

Run it (2 CPU processes, a few seconds):

    python examples/fsdp_manual_wrap.py
    python examples/fsdp_manual_wrap.py --strategy ddp     # same model code, wrap() does nothing
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifabric import Accelerator, FSDPStrategy, wrap

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = (
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        # wrap() inside acc.init_module(): each block becomes its own FSDP unit right here.
        # The input and output layers are left to the root unit, which setup() shards last.
        self.blocks = nn.Sequential(*(wrap(Block(width)) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


if args.strategy == "fsdp":
    strategy = FSDPStrategy(activation_checkpointing_policy={Block})
else:
    strategy = "ddp"
acc = Accelerator(accelerator="cpu", devices=args.devices, strategy=strategy)
acc.launch()
acc.seed_everything(0)

with acc.init_module(empty_init=True):  # wrap() needs to run inside init_module to see the strategy
    model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = acc.setup(model, optimizer)  # shards the root (blocks are units already)
acc.print(model.module.blocks[0].__class__.__name__)  # FSDPBlock under fsdp, Block under ddp

generator = torch.Generator().manual_seed(acc.global_rank)
target = nn.Linear(16, 1)  # a fixed random function to learn (same on every rank: seeded above)
for step in range(1, args.steps + 1):
    x = torch.randn(64, 16, generator=generator)
    loss = F.mse_loss(model(x), target(x).detach())
    optimizer.zero_grad()
    acc.backward(loss)
    optimizer.step()
    if step % 5 == 0:
        acc.print(f"step {step}: loss {acc.all_reduce(loss.detach()).item():.4f}")
