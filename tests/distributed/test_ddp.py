"""DDP on 2 gloo processes: numerics against one process, gradient accumulation, clipping."""

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS = 10
GLOBAL_BATCH = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 4, generator=generator), torch.randn(
        STEPS, GLOBAL_BATCH, 2, generator=generator
    )


def _train(acc: Accelerator, x: torch.Tensor, y: torch.Tensor) -> tuple[nn.Module, list[float]]:
    """AdamW steps with clipping; the batches of step i are x[i], y[i]."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = acc.setup(model, optimizer)
    norms = []
    for xi, yi in zip(x, y, strict=True):
        acc.backward(nn.functional.mse_loss(model(xi), yi))
        norms.append(float(acc.clip_gradients(model, optimizer, max_norm=1e3)))
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


def _accumulate(acc: Accelerator, model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], ...]:
    """Two micro-batches, the first without gradient sync; return grads after each."""
    with acc.no_backward_sync(model):
        acc.backward(model(x[0]).sum())
    local = [p.grad.clone() for p in model.parameters()]
    acc.backward(model(x[1]).sum())
    return local, [p.grad.clone() for p in model.parameters()]


def _ddp_rank(rank: int) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    x, y = _data()
    half = GLOBAL_BATCH // 2
    shard = slice(rank * half, (rank + 1) * half)
    model, norms = _train(acc, x[:, shard], y[:, shard])
    local, synced = _accumulate(acc, model, x[:2, shard])
    return {
        "world": acc.world_size,
        "params": [p.detach().clone() for p in model.parameters()],
        "norms": norms,
        "local": local,
        "synced": synced,
    }


@pytest.fixture(scope="module")
def ddp_results():
    return run_distributed(_ddp_rank, 2, timeout=150)


@pytest.fixture(scope="module")
def reference():
    acc = Accelerator(accelerator="cpu", devices=1)
    x, y = _data()
    return _train(acc, x, y)


def test_ddp_on_half_batches_matches_one_process_on_the_whole_batch(ddp_results, reference):
    ref_model, _ = reference
    for rank, result in enumerate(ddp_results):
        assert result["world"] == 2
        for actual, expected in zip(result["params"], ref_model.parameters(), strict=True):
            torch.testing.assert_close(actual, expected.detach(), rtol=0, atol=1e-6, msg=f"rank {rank}")


def test_clip_gradients_returns_the_single_process_norm(ddp_results, reference):
    _, ref_norms = reference
    for result in ddp_results:
        torch.testing.assert_close(
            torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6
        )


def test_no_backward_sync_skips_communication_then_the_next_backward_averages(ddp_results):
    local0, local1 = ddp_results[0]["local"], ddp_results[1]["local"]
    assert any(not torch.equal(a, b) for a, b in zip(local0, local1, strict=True))  # no sync inside
    for a, b in zip(ddp_results[0]["synced"], ddp_results[1]["synced"], strict=True):
        assert torch.equal(a, b)

    # The synced gradient is the rank average of each rank's two micro-batch gradients.
    model = _model()
    model.load_state_dict(dict(zip(model.state_dict(), ddp_results[0]["params"], strict=True)))
    x, _ = _data()
    half = GLOBAL_BATCH // 2
    for rank in range(2):
        model(x[0, rank * half : (rank + 1) * half]).sum().backward()
        model(x[1, rank * half : (rank + 1) * half]).sum().backward()
    for actual, p in zip(ddp_results[0]["synced"], model.parameters(), strict=True):
        torch.testing.assert_close(actual, p.grad / 2, rtol=1e-5, atol=1e-6)
