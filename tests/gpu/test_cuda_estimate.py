"""The memory estimator against ``torch.cuda.max_memory_allocated`` of the same training step (+-15%)."""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CUDA_MARKS
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss

pytestmark = CUDA_MARKS

# big enough that what the estimator leaves out (cuBLAS workspaces, kernel scratch) is a small part
MODEL = {"vocab_size": 8192, "block_size": 512, "n_layer": 4, "n_head": 8, "n_embd": 1024, "tied": False}
BATCH = (8, 512)
STEPS = 2  # the second step runs with the optimizer state in place


def make_gpt(**kwargs) -> GPT:
    """The factory the estimator and the measured run share."""
    return GPT(GPTConfig(**kwargs))


def _measure(rank: int, device: str, strategy: str, precision: str) -> int | None:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1, precision=precision)
    acc.launch()
    batch = torch.randint(0, MODEL["vocab_size"], (BATCH[0], BATCH[1] + 1), device=acc.device)
    cuda = acc.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with acc.init_module(empty_init=strategy == "fsdp"):
        model = make_gpt(**MODEL)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    for _ in range(STEPS):
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_estimate_is_within_15_percent_of_the_cuda_peak(strategy, precision):
    from minifabric import estimate_memory

    (measured,) = run_distributed(_measure, 1, "cuda", strategy, precision, timeout=240)
    estimated = estimate_memory(
        make_gpt, model_kwargs=MODEL, strategy=strategy, world_size=1, precision=precision, batch_shape=BATCH
    ).total
    assert abs(estimated - measured) <= 0.15 * measured, (estimated, measured, estimated / measured)
