"""``init_module(empty_init=True)`` on one device: meta parameters, materialized and initialized at setup."""

import pytest
import torch
from torch import nn

from minifabric import Accelerator


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 10)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.embed(idx)))


class NoReset(nn.Module):
    """Owns a parameter but cannot re-initialize it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class WithNoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.custom = NoReset()


def test_empty_init_creates_meta_parameters_and_real_buffers(acc):
    with acc.init_module(empty_init=True):
        model = Block()
    assert all(p.is_meta for p in model.parameters())
    assert not model.mask.is_meta
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))


def test_setup_materializes_with_the_same_weights_as_eager_init(acc):
    torch.manual_seed(3)
    eager = Block()
    torch.manual_seed(3)
    with acc.init_module(empty_init=True):
        model = Block()
    model = acc.setup(model)
    assert not any(p.is_meta for p in model.parameters())
    for (name, expected), actual in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name


def test_optimizer_built_over_meta_parameters_trains_after_setup(acc):
    with acc.init_module(empty_init=True):
        model = Block()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    before = model.proj.weight.detach().clone()
    acc.backward(model(torch.tensor([[1, 2, 3]])).sum())
    optimizer.step()
    assert not torch.equal(before, model.proj.weight)
    assert optimizer.param_groups[0]["params"][0] is model.embed.weight


def test_tied_weights_stay_tied(acc):
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = Block()
        model.proj.weight = model.embed.weight  # (10, 8) both
    model = acc.setup(model)
    assert model.proj.weight is model.embed.weight
    assert not model.proj.weight.is_meta


def test_empty_init_uses_the_precision_dtype():
    acc = Accelerator(accelerator="cpu", precision="bf16-true")
    with acc.init_module(empty_init=True):
        model = Block()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model = acc.setup(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_module_that_cannot_be_initialized_raises_naming_it(acc):
    with acc.init_module(empty_init=True):
        model = WithNoReset()
    with pytest.raises(TypeError, match=r"Module 'custom' \(NoReset\).*def reset_parameters"):
        acc.setup(model)


def test_init_weights_on_the_root_is_used_instead(acc):
    class Root(WithNoReset):
        def init_weights(self) -> None:
            self.linear.reset_parameters()
            self.custom.scale.fill_(2.0)

    with acc.init_module(empty_init=True):
        model = Root()
    model = acc.setup(model)
    assert torch.equal(model.custom.scale, torch.full((3,), 2.0))


def test_without_empty_init_parameters_are_real_on_the_device(acc):
    with acc.init_module():
        model = Block()
    assert all(p.device == acc.device and not p.is_meta for p in model.parameters())


def test_saving_a_model_still_on_meta_raises(acc, tmp_path):
    with acc.init_module(empty_init=True):
        model = Block()
    with pytest.raises(RuntimeError, match=r"still has meta parameters.*acc\.setup\(model\)"):
        acc.save(tmp_path / "ckpt.pt", {"model": model})
