"""A tiny FSDP job that reports where each rank runs: use it to check a multi-node launch.

Two simulated nodes on one machine (``launch_two_nodes.sh``, a few seconds):

    bash examples/multinode/launch_two_nodes.sh

which starts, in two shells or two machines (node 1 points --main-address at node 0):

    minifabric run --num-nodes 2 --node-rank 0 --devices 1 --main-address 127.0.0.1 --main-port 29510 examples/multinode/train.py
    minifabric run --num-nodes 2 --node-rank 1 --devices 1 --main-address 127.0.0.1 --main-port 29510 examples/multinode/train.py

On SLURM: ``sbatch examples/multinode/slurm.sbatch`` (srun starts every process; ``launch()`` joins).
"""

import argparse
import socket

import torch
import torch.nn.functional as F

from minifabric import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--num-nodes", type=int, default=1, help="for srun; `minifabric run` passes its own")
parser.add_argument("--accelerator", default="auto")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

# devices="auto": take the number of processes per node from the launcher (minifabric run, srun, torchrun)
acc = Accelerator(accelerator=args.accelerator, devices="auto", num_nodes=args.num_nodes, strategy="fsdp")
acc.launch()
acc.seed_everything(0)
print(
    f"rank {acc.global_rank}/{acc.world_size} (node {acc.node_rank}, local rank {acc.local_rank})"
    f" on {socket.gethostname()}, device {acc.device}",
    flush=True,
)

with acc.init_module(empty_init=True):
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = acc.setup(model, optimizer)

generator = torch.Generator().manual_seed(acc.global_rank)
for _ in range(args.steps):
    x = torch.randn(16, 32, generator=generator).to(acc.device)
    loss = F.mse_loss(model(x), x.flip(1))
    optimizer.zero_grad()
    acc.backward(loss)
    optimizer.step()
ranks = acc.all_gather(torch.tensor([acc.global_rank], device=acc.device)).flatten().tolist()
acc.print(
    f"all {acc.world_size} ranks answered: {ranks}; final loss {acc.all_reduce(loss.detach()).item():.4f}"
)
