"""Training that survives a restart: save every k steps, resume from the newest committed checkpoint.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/scripts/elastic.py --ckpt DIR --kill-step 4

With ``--kill-step S`` rank 1 of the first attempt dies (``os._exit``) right after step S; torchrun
restarts every rank and the new attempt resumes from the last committed checkpoint. Also runs one
process per pod as Kubeflow starts it, or under srun (the environment decides). Prints
``RESULT rank=R world=W attempt=A resumed=STEP weights=HEX`` per rank (the weights' bytes).
"""

import argparse
import os
import time

import torch

from minifabric import Accelerator, latest_checkpoint


def train(acc: Accelerator, ckpt: str, steps: int = 8, every: int = 2, die_at: int = -1) -> tuple[int, str]:
    """Train ``steps`` steps from the newest checkpoint under ``ckpt``; return (step resumed at, weights as hex).

    Rank 1 ends its process (``os._exit(3)``) right after step ``die_at``.
    """
    acc.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    last = latest_checkpoint(ckpt)
    if last is not None:
        acc.load(last, state)
    resumed = state["step"]
    for step in range(state["step"], steps):
        data = torch.Generator().manual_seed(1000 * step + acc.global_rank)  # the data of (step, rank)
        x = torch.randn(16, 4, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % every == 0:
            state["step"] = step + 1
            acc.save(os.path.join(ckpt, f"step-{step + 1:04d}"), state)
        if step == die_at and acc.global_rank == 1:
            print(f"KILLED rank=1 step={step}", flush=True)
            os._exit(3)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return resumed, weights.numpy().tobytes().hex()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()

    print(f"START at={time.time():.3f}", flush=True)  # the library's part of the run starts here
    acc = Accelerator(accelerator="cpu", strategy=args.strategy)
    acc.launch()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed, weights = train(acc, args.ckpt, args.steps, args.every, args.kill_step if attempt == 0 else -1)
    print(
        f"RESULT rank={acc.global_rank} world={acc.world_size} attempt={attempt} resumed={resumed}"
        f" weights={weights}",
        flush=True,
    )


if __name__ == "__main__":
    main()
