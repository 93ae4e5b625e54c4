"""nanoGPT's accumulation switch, ``model.require_backward_grad_sync = False``, on the set-up model.

Under DDP and FSDP the micro-steps with the switch off must not communicate (DDP: each rank keeps
its own gradient; FSDP: no reduce-scatter, so no sharded gradient yet), and the step must equal
accumulation with ``acc.no_backward_sync`` bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.init_styles import full_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

MICRO_STEPS = 3


def _train(acc: Accelerator, switch: bool) -> tuple[dict[str, torch.Tensor], list[bool]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    data = torch.randn(MICRO_STEPS, 4, 4, generator=torch.Generator().manual_seed(acc.global_rank))
    synced_early = []
    for micro in range(MICRO_STEPS):
        last = micro == MICRO_STEPS - 1
        if switch:
            model.require_backward_grad_sync = last
            acc.backward(model(data[micro]).pow(2).mean())
        else:
            with acc.no_backward_sync(model, enabled=not last):
                acc.backward(model(data[micro]).pow(2).mean())
        if not last:
            synced_early.append(_synced(acc, model))
    optimizer.step()
    return full_state(model), synced_early


def _synced(acc: Accelerator, model: nn.Module) -> bool:
    grads = [p.grad for p in model.parameters()]
    if any(hasattr(g, "full_tensor") for g in grads if g is not None) or all(g is None for g in grads):
        return any(g is not None for g in grads)  # FSDP: a sharded gradient exists only once reduced
    gathered = acc.all_gather(torch.cat([g.flatten() for g in grads]))
    return bool(torch.equal(gathered[0], gathered[1]))  # DDP: equal on both ranks only if averaged


def accumulate(rank: int, world_size: int, strategy: str) -> dict:
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=world_size)
    acc.launch()
    switched, synced_early = _train(acc, switch=True)
    reference, _ = _train(acc, switch=False)
    return {
        "synced_early": synced_early,
        "differs": [name for name in reference if not torch.equal(reference[name], switched[name])],
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_require_backward_grad_sync_false_accumulates_without_communication(strategy: str) -> None:
    results = run_distributed(accumulate, 2, 2, strategy, timeout=200)
    assert results == [{"synced_early": [False] * (MICRO_STEPS - 1), "differs": []}] * 2
