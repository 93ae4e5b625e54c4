"""Meta-device init against unusual but legitimate init code: bitwise equal to eager construction.

Each model is built eagerly and inside ``init_module(empty_init=True)`` from the same seed; after
``setup`` every parameter and buffer is bitwise equal, and so are the torch and numpy random streams
after construction. The first group are calls torch does not let a ``TorchFunctionMode`` see
(``Tensor.set_``, used by ``register_parametrization`` and ``remove_parametrizations``); the rest
keep common idioms working.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.init_styles import mismatches


class SetToDerived(nn.Module):
    """``Tensor.set_`` to a tensor computed from another parameter, then written through."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.set_(self.a.weight.detach() * 3)
            self.b.weight.add_(1)


class Orthogonal(nn.Module):
    """``orthogonal`` replaces the original with ``-I`` through ``Tensor.set_`` (square: matrix_exp)."""

    def __init__(self) -> None:
        super().__init__()
        self.sq = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
        self.rect = nn.utils.parametrizations.orthogonal(nn.Linear(4, 6))
        self.after = nn.Linear(4, 4)


class RemoveParametrizations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
        nn.utils.parametrize.remove_parametrizations(self.o, "weight", leave_parametrized=True)
        self.w = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
        nn.utils.parametrize.remove_parametrizations(self.w, "weight")


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class Idioms(nn.Module):
    """In-place chains, indexing writes, explicit generators, partial/lambda inits, numpy, buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        gen = torch.Generator().manual_seed(123)
        self.g = nn.Parameter(torch.randn(5, generator=gen))
        with torch.no_grad():
            self.a.weight.mul_(2).add_(1).clamp_(-1, 2).div_(3)
            self.a.weight[0] = 5.0
            self.a.weight[:, 2] = torch.randn(6)
            self.a.bias.copy_(torch.from_numpy(np.random.rand(6).astype(np.float32)))
            self.b.weight.masked_fill_(torch.rand_like(self.b.weight) > 0.5, 0.0)
        functools.partial(nn.init.normal_, std=0.02, generator=gen)(self.b.bias)
        (lambda t: nn.init.trunc_normal_(t, std=0.1))(self.b.weight)
        self.register_buffer("proj", torch.randn(4, 4))
        self.sym = nn.Linear(4, 4)
        nn.utils.parametrize.register_parametrization(self.sym, "weight", _Symmetric())


class TorchLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, kdim=4, vdim=6, add_bias_kv=True)
        self.lstm = nn.LSTM(4, 6, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(4, 5)
        self.tr = nn.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
        self.emb = nn.Embedding(10, 4, padding_idx=3)
        self.bn = nn.BatchNorm1d(4)
        self.bn.running_mean.normal_()
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied across modules


class SeedsAndLoops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers = []
        for _ in range(3):
            layers.append(nn.Linear(4, 4))
            if torch.rand(()) > 0.5:
                torch.randn(2)
        self.layers = nn.ModuleList(layers)
        torch.manual_seed(42)
        self.b = nn.Linear(4, 4)
        if self.b.weight.sum() > 0:  # a Python branch on the values
            self.c = nn.Linear(4, 2)
        else:
            self.c = nn.Linear(4, 3)


class ReadsAsNumpy(nn.Module):
    """``.numpy()`` of a parameter (meta tensors have no numpy form): its value so far."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight.data = torch.from_numpy(self.a.weight.detach().numpy() * 2)
        nn.init.zeros_(self.a.weight)


CASES = {
    c.__name__: c
    for c in (
        SetToDerived,
        Orthogonal,
        RemoveParametrizations,
        ReadsAsNumpy,
        Idioms,
        TorchLayers,
        SeedsAndLoops,
    )
}


def _hf(family: str) -> nn.Module:
    import transformers as tf

    if family == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
        )
    if family == "llama":
        from tests.hf_tiny import build

        return build("llama")
    if family == "bert":
        config = tf.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32,
        )  # fmt: skip
        return tf.BertForMaskedLM(config)
    config = tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    return tf.T5ForConditionalGeneration(config)


def _check(strategy: str, build, precision: str | None = None) -> None:
    kwargs = {"precision": precision} if precision else {}
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy, **kwargs)
    acc.launch()
    torch.manual_seed(0)
    np.random.seed(0)
    with acc.init_module(empty_init=False):
        eager = build()
    streams = (torch.rand(8), np.random.rand())
    torch.manual_seed(0)
    np.random.seed(0)
    with acc.init_module(empty_init=True):
        model = build()
    assert torch.equal(torch.rand(8), streams[0]), "the torch random stream after construction differs"
    assert np.random.rand() == streams[1], "the numpy random stream after construction differs"
    assert mismatches(acc.setup(eager), acc.setup(model)) == []


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_unusual_init_code_equals_eager_construction(case: str, strategy: str) -> None:
    _check(strategy, CASES[case])


@pytest.mark.parametrize("case", ["SetToDerived", "Idioms"])
def test_unusual_init_code_equals_eager_construction_in_bf16(case: str) -> None:
    _check("single", CASES[case], precision="bf16-true")


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5"])
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_transformers_families_equal_eager_construction(family: str, strategy: str) -> None:
    pytest.importorskip("transformers")
    _check(strategy, lambda: _hf(family))


class _SetToNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        with torch.no_grad():
            self.l.weight.set_()  # unseen by torch function modes, and to no recorded tensor


def test_data_replaced_unseen_with_an_unknown_value_is_refused_naming_the_call() -> None:
    acc = Accelerator(accelerator="cpu", devices=1)
    with acc.init_module(empty_init=True):
        model = _SetToNothing()
    with pytest.raises(ValueError, match=r"'l\.weight'.*`Tensor\.set_`.*empty_init=False"):
        acc.setup(model)


class _NumpyAndRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import random

        self.l = nn.Linear(4, 3)
        with torch.no_grad():
            self.l.bias.copy_(torch.from_numpy(np.random.rand(3).astype(np.float32)))
            self.l.weight.fill_(random.random())


def test_the_self_check_rebuilds_from_the_numpy_and_python_random_states_and_restores_them() -> None:
    """An init drawing from ``np.random`` / ``random`` passes the self-check, which leaves their streams as it found them."""
    import random

    acc = Accelerator(accelerator="cpu", devices=1)
    streams = []
    for verify in (False, True):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        with acc.init_module(empty_init=True, verify=verify):
            model = _NumpyAndRandom()
        acc.setup(model)  # with verify: builds it again eagerly and compares
        streams.append((np.random.rand(), random.random(), torch.rand(1).item()))
    assert streams[0] == streams[1]


def test_a_write_through_the_numpy_form_of_a_meta_parameter_is_refused() -> None:
    """In eager construction the array aliases the parameter: a write through it cannot be recorded."""
    acc = Accelerator(accelerator="cpu", devices=1)
    with acc.init_module(empty_init=True):
        layer = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="read-only"):
            layer.weight.detach().numpy()[:] = 1.0


def _two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _normal_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_an_init_applied_after_the_context_ended_is_refused_naming_the_fix(strategy: str) -> None:
    """On meta that write computes nothing and is not recorded: refused, not silently dropped."""
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = _two_linears()
    model.apply(_normal_init)
    with pytest.raises(
        ValueError, match=r"'0\.weight'.*changed in place after.*Move the init into the block"
    ):
        acc.setup(model)
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):  # the fix the message shows
        model = _two_linears()
        model.apply(_normal_init)
    torch.manual_seed(0)
    eager = _two_linears()
    eager.apply(_normal_init)
    assert mismatches(eager, acc.setup(model)) == []


def test_nested_init_module_contexts_record_once() -> None:
    acc = Accelerator(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    eager = _two_linears()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        with acc.init_module(empty_init=True):
            model = _two_linears()
        assert model[0].weight.is_meta
    assert mismatches(eager, acc.setup(model)) == []
