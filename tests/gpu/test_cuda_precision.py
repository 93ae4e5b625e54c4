"""Every precision on one GPU, with ``strategy="single"`` and ``"fsdp"``: dtypes, compute dtype, training."""

from __future__ import annotations

import functools

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CFG, CUDA_MARKS, batches, train
from tests.helpers import run_distributed
from tests.models import GPT
from tests.unit.test_precision import DTYPES

pytestmark = CUDA_MARKS

PRECISIONS = DTYPES  # precision -> (dtype the parameters are stored in, dtype forward computes in)


def _train_in_precision(rank: int, device: str, strategy: str, precision: str) -> dict:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1, precision=precision)
    acc.launch()
    torch.manual_seed(0)
    model = GPT(CFG)  # on the CPU for both strategies (meta init on CUDA is tested in test_cuda_init.py)
    # SGD: Adam's eps=1e-8 is 0 in fp16, and a parameter whose gradient is 0 would turn nan
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[torch.dtype] = []
    hook = model.module.blocks[0].fc.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    data = batches(1).expand(5, -1, -1)  # one batch, five steps: the loss must go down
    losses = train(acc, model, optimizer, data)
    hook.remove()
    params = list(model.parameters())
    return {
        "losses": losses,
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "param_devices": sorted({getattr(p, "_local_tensor", p).device.type for p in params}),
        "compute_dtype": str(seen[0]),
    }


@functools.cache
def _trained(strategy: str, precision: str) -> dict:
    """One run per strategy and precision, shared by the tests below."""
    (result,) = run_distributed(_train_in_precision, 1, "cuda", strategy, precision, timeout=240)
    return result


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precision_trains_on_cuda_with_its_dtypes(precision, strategy):
    result = _trained(strategy, precision)
    stored, compute = PRECISIONS[precision]
    assert result["param_dtypes"] == [str(stored)]
    assert result["param_devices"] == ["cuda"]
    assert result["compute_dtype"] == str(compute)
    losses = torch.tensor(result["losses"])
    assert torch.isfinite(losses).all(), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true", "16-true"])
def test_fsdp_at_world_size_one_trains_like_one_device(precision):
    # the same arithmetic (no casts in between); only kernel choices and atomics differ: a tolerance
    single, sharded = _trained("single", precision), _trained("fsdp", precision)
    tolerance = {"32-true": 1e-4, "64-true": 1e-10}.get(precision, 2e-2)
    torch.testing.assert_close(
        torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=tolerance, atol=tolerance
    )


def _fp16_scaler_under_fsdp(rank: int, device: str) -> dict:
    acc = Accelerator(accelerator=device, strategy="fsdp", devices=1, precision="16-mixed")
    acc.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = acc.precision.scaler
    before = {k: v.full_tensor().clone() for k, v in model.module.state_dict().items()}
    first_scale = scaler.get_scale()
    acc.backward(model(torch.randn(4, 8, device=acc.device)).sum() * float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    skipped = all(torch.equal(v.full_tensor(), before[k]) for k, v in model.module.state_dict().items())
    after_inf = scaler.get_scale()
    acc.backward(model(torch.randn(4, 8, device=acc.device)).mean())  # scaled, still finite in fp16
    optimizer.step()
    stepped = not all(torch.equal(v.full_tensor(), before[k]) for k, v in model.module.state_dict().items())
    return {"skipped": skipped, "stepped": stepped, "scales": (first_scale, after_inf), "scaler": type(scaler).__name__}


def test_fp16_scaler_under_fsdp_skips_the_inf_step_and_lowers_the_scale_on_cuda():
    (result,) = run_distributed(_fp16_scaler_under_fsdp, 1, "cuda", timeout=240)
    assert result["skipped"], result
    assert result["scales"][1] < result["scales"][0], result
    assert result["stepped"], result  # a finite step after it changes the model
