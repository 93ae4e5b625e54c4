"""The six precision strings: stored dtypes, forward dtypes, and fp16 loss scaling."""

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from minifabric.precision import MixedPrecision, Precision, TruePrecision, precision_from_string

# precision -> (parameter dtype, dtype forward computes in)
DTYPES = {
    "32-true": (torch.float32, torch.float32),
    "64-true": (torch.float64, torch.float64),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}


class Recorder(nn.Module):
    """A linear layer that records the dtypes its forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["input"] = x.dtype
        out = self.linear(x)
        self.seen["compute"] = out.dtype
        return out


def _accelerator(precision: str) -> Accelerator:
    acc = Accelerator(accelerator="cpu", precision=precision)
    acc.launch()
    return acc


@pytest.mark.parametrize("precision", list(DTYPES))
def test_module_inputs_and_outputs_get_the_documented_dtypes(precision):
    param_dtype, compute_dtype = DTYPES[precision]
    acc = _accelerator(precision)
    model = acc.setup(Recorder())
    assert {p.dtype for p in model.parameters()} == {param_dtype}
    out = model(torch.randn(2, 4))
    # every precision casts floating-point inputs to the dtype forward computes in (as Fabric does)
    assert model.seen["input"] == compute_dtype
    assert model.seen["compute"] == compute_dtype
    assert out.dtype == torch.float32  # outputs come back in the default dtype


@pytest.mark.parametrize("precision", list(DTYPES))
def test_init_module_and_init_tensor_use_the_stored_dtype(precision):
    param_dtype, _ = DTYPES[precision]
    acc = _accelerator(precision)
    with acc.init_module():
        layer = nn.Linear(2, 2)
    with acc.init_tensor():
        tensor = torch.ones(3)
    assert layer.weight.dtype == param_dtype
    assert tensor.dtype == param_dtype
    assert tensor.device == acc.device
    assert torch.get_default_dtype() == torch.float32  # restored on exit


@pytest.mark.parametrize("precision", list(DTYPES))
def test_every_precision_trains(precision):
    acc = _accelerator(precision)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    before = model.weight.detach().clone()
    # "16-mixed" skips the first steps while its loss scale comes down from 2**16 to what fits fp16
    for _ in range(10 if precision == "16-mixed" else 1):
        acc.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(model.weight).all()
    assert not torch.equal(before, model.weight)


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_autocast_is_the_forward_context(precision, dtype):
    acc = _accelerator(precision)
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    with acc.autocast():
        assert (a @ b).dtype == dtype


def test_plugin_classes_per_string():
    assert type(precision_from_string("32-true", "cpu")) is Precision
    for name in ("64-true", "bf16-true", "16-true"):
        assert type(precision_from_string(name, "cpu")) is TruePrecision
    for name in ("bf16-mixed", "16-mixed"):
        assert type(precision_from_string(name, "cpu")) is MixedPrecision
    assert precision_from_string("bf16-mixed", "cpu").scaler is None
    assert precision_from_string("16-mixed", "cpu").scaler is not None


def _fp16_setup():
    acc = _accelerator("16-mixed")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    x = 0.01 * torch.randn(8, 4)  # small enough that the scaled fp16 gradients do not overflow
    return acc, model, optimizer, x


def _reference_grad(model, x):
    """The unscaled gradient of the same autocast forward."""
    reference = nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = reference(x).float().pow(2).mean()
    loss.backward()
    return reference.weight.grad


def test_16_mixed_scales_the_loss_and_unscales_before_clipping():
    acc, model, optimizer, x = _fp16_setup()
    expected = _reference_grad(model, x)
    scale = acc.precision.scaler.get_scale()
    assert scale > 1
    acc.backward(model(x).pow(2).mean())
    torch.testing.assert_close(model.weight.grad / scale, expected, rtol=1e-3, atol=1e-6)
    norm = acc.clip_gradients(model, optimizer, max_norm=1e6)
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-3, atol=1e-6)
    assert norm < 1e3  # the norm of the unscaled gradients
    before = model.weight.detach().clone()
    optimizer.step()
    torch.testing.assert_close(model.weight, before - 0.1 * expected, rtol=1e-3, atol=1e-6)


def test_16_mixed_skips_a_step_with_inf_gradients_and_lowers_the_scale():
    acc, model, optimizer, x = _fp16_setup()
    scale = acc.precision.scaler.get_scale()
    acc.backward(model(x).pow(2).mean())
    model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert acc.precision.scaler.get_scale() < scale
    optimizer.zero_grad()
    acc.backward(model(x).pow(2).mean())
    optimizer.step()  # finite gradients step again
    assert not torch.equal(before[0], model.weight)


def test_16_mixed_scaler_state_is_checkpointed():
    acc, model, optimizer, x = _fp16_setup()
    acc.backward(model(x).pow(2).mean())
    model.weight.grad[0, 0] = float("nan")
    optimizer.step()
    state = acc.precision.state_dict()
    fresh = precision_from_string("16-mixed", "cpu")
    fresh.load_state_dict(state)
    assert fresh.scaler.get_scale() == acc.precision.scaler.get_scale()


def test_16_mixed_step_after_a_plain_backward_names_acc_backward():
    _, model, optimizer, x = _fp16_setup()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"replace `loss.backward\(\)` with `acc.backward\(loss\)`"):
        model(x).pow(2).mean().backward()  # not acc.backward: refused at once, as Fabric refuses it
    with pytest.raises(RuntimeError, match=r"Replace `loss.backward\(\)` with `acc.backward\(loss\)`"):
        optimizer.step()  # and the step still refuses gradients that were never scaled
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_16_mixed_plain_backward_after_scaled_steps_still_raises():
    acc, model, optimizer, x = _fp16_setup()
    acc.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="16-mixed"):
        model(x).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="16-mixed"):
        optimizer.step()


def test_16_mixed_two_optimizers_each_after_their_own_backward():
    acc = _accelerator("16-mixed")
    first, second = nn.Linear(4, 1), nn.Linear(4, 1)
    first, opt_first = acc.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second, opt_second = acc.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    x = 0.01 * torch.randn(8, 4)
    for _ in range(2):  # GAN-style: backward, step, backward, step
        acc.backward(first(x).pow(2).mean())
        opt_first.step()
        acc.backward(second(x).pow(2).mean())
        opt_second.step()
