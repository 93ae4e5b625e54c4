"""What the CUDA tier's modules share: the skip marks, a tiny untied GPT, a training loop, full states.

Every worker takes the device type as its first argument after the rank, so the same code runs on
the CPU (gloo) where no GPU is present; the tests pass ``"cuda"``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.models import GPTConfig, gpt_loss, token_batches

#: the marks of every CUDA test module: one GPU, world size 1. No pytest-timeout mark: the GPU image
#: may lack the plugin; every process a test starts has its own timeout (run_distributed, Session).
CUDA_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tied=False)


def batches(steps: int = 4, batch_size: int = 4) -> torch.Tensor:
    """The same token batches in every process (fixed seed)."""
    return token_batches(steps, batch_size, CFG)


def train(acc: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor) -> list[float]:
    """One optimizer step per batch on ``acc.device``; the losses."""
    losses = []
    for batch in data.to(acc.device):
        loss = gpt_loss(model, batch)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's full value on the CPU. A DTensor on one rank holds all of it: its local tensor is read
    without a collective (shards offloaded to the CPU cannot go through nccl)."""
    if hasattr(t, "full_tensor"):
        t = t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()
    return t.detach().cpu().clone()


def _name(name: str) -> str:
    return name.removeprefix("_forward_module.").removeprefix("module.")


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (persistent or not) as full CPU tensors, named as in the plain model."""
    return {_name(n): _whole(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def mismatches(expected: nn.Module, actual: nn.Module) -> list[str]:
    """Names whose values differ (bitwise) between two models, or that only one of them has."""
    a, b = cpu_state(expected), cpu_state(actual)
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def adam_moments(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's first Adam moment as a full CPU tensor, by parameter name."""
    names = {id(p): _name(n) for n, p in model.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)
    return {names[id(param)]: _whole(state["exp_avg"]) for param, state in inner.state.items()}
