"""``init_module(empty_init=True)`` on one device: meta parameters, recorded init replayed at setup."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.init_styles import STYLES, mismatches

OUTSIDE = torch.zeros(4, device="meta")  # a meta tensor made outside init_module: its value is unknown


@pytest.fixture
def acc():
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    return acc


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 10)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.embed(idx)))


class NeverInitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.empty(3))  # eager leaves this as uninitialized memory


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_init_styles_equal_eager_construction(style, strategy):
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    torch.manual_seed(7)
    eager = STYLES[style]()
    after_eager = torch.rand(4)
    torch.manual_seed(7)
    with acc.init_module(empty_init=True):
        model = STYLES[style]()
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(torch.rand(4), after_eager), "the random stream after init differs from eager"
    model = acc.setup(model)
    assert mismatches(eager, model) == []


class UnusualInit(nn.Module):
    """Init that reads other parameters, replaces ``.data``, uses views, generators and rare nn.init."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 4, bias=False)
        self.b.weight.data.copy_(self.a.weight.data.t() * 0.5)  # reads a's value as of now
        nn.init.normal_(self.a.weight)  # ... which changes afterwards
        w = self.c.weight
        w.data = nn.init.trunc_normal_(w.data.to(torch.float64), std=0.02).to(w.dtype)
        nn.init.uniform_(self.a.bias, -1, 1, generator=torch.Generator().manual_seed(5))
        nn.init.xavier_uniform_(self.b.weight[:2])
        with torch.no_grad():
            self.b.bias += 1
            self.b.bias[1:3] = torch.tensor([7.0, 8.0])
        self.eye = nn.Parameter(torch.randn(3, 3))
        nn.init.eye_(self.eye)
        self.orth = nn.Parameter(torch.empty(8, 3))
        nn.init.orthogonal_(self.orth)
        self.dirac = nn.Parameter(torch.empty(4, 2, 3))
        nn.init.dirac_(self.dirac)
        self.sparse = nn.Parameter(torch.empty(6, 5))
        nn.init.sparse_(self.sparse, 0.5)
        self.clamped = nn.Parameter(torch.empty(3, 3))
        nn.init.kaiming_normal_(self.clamped)
        self.clamped.data.clamp_(-0.1, 0.1)


def test_unusual_init_equals_eager_construction(acc):
    torch.manual_seed(0)
    eager = UnusualInit()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = UnusualInit()
    assert all(p.is_meta for p in model.parameters())
    assert mismatches(eager, acc.setup(model)) == []


def test_empty_init_creates_meta_parameters_and_real_buffers(acc):
    with acc.init_module(empty_init=True):
        model = Block()
    assert all(p.is_meta for p in model.parameters())
    assert not model.mask.is_meta
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))


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


def test_tied_weights_stay_tied_with_the_value_of_the_last_init(acc):
    def build() -> Block:
        model = Block()
        model.proj.weight = model.embed.weight  # (10, 8) both
        nn.init.normal_(model.proj.weight, std=0.5)
        return model

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = build()
    model = acc.setup(model)
    assert model.proj.weight is model.embed.weight
    assert mismatches(eager, model) == []


def test_empty_init_uses_the_precision_dtype():
    acc = Accelerator(accelerator="cpu", precision="bf16-true")
    torch.manual_seed(0)
    with acc.init_module(empty_init=False):
        eager = Block()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = Block()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model = acc.setup(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert mismatches(eager, model) == []


def test_a_parameter_never_initialized_raises_naming_it(acc):
    with acc.init_module(empty_init=True):
        model = NeverInitialized()
    with pytest.raises(
        ValueError, match=r"parameter 'scale' of NeverInitialized.*torch.nn.init.normal_\(self.scale"
    ):
        acc.setup(model)
    assert model.scale.is_meta  # nothing changed


def test_an_init_that_reads_an_unknown_meta_tensor_raises_naming_it(acc):
    class ReadsOutside(Block):
        def __init__(self) -> None:
            super().__init__()
            self.norm.weight.data.add_(OUTSIDE[:8].sum())

    with acc.init_module(empty_init=True):
        model = ReadsOutside()
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' of ReadsOutside \(in LayerNorm\).*`add_`"):
        acc.setup(model)


def test_init_weights_called_in_init_is_reproduced(acc):
    class Root(NeverInitialized):
        def __init__(self) -> None:
            super().__init__()
            self.init_weights()

        def init_weights(self) -> None:
            nn.init.trunc_normal_(self.linear.weight, std=0.1)
            nn.init.orthogonal_(self.linear.weight)
            self.scale.data.uniform_(-1, 1)

    torch.manual_seed(1)
    eager = Root()
    torch.manual_seed(1)
    with acc.init_module(empty_init=True):
        model = Root()
    assert mismatches(eager, acc.setup(model)) == []


def test_models_built_after_another_was_set_up(acc):
    torch.manual_seed(0)
    first_eager, second_eager = STYLES["nanogpt"](), STYLES["hf"]()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        first = STYLES["nanogpt"]()
    first = acc.setup(first)
    with acc.init_module(empty_init=True):
        second = STYLES["hf"]()
    second, optimizer = acc.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    assert mismatches(first_eager, first) == [] and mismatches(second_eager, second) == []
    before = second.lm_head.weight.detach().clone()
    acc.backward(second(torch.tensor([[1, 2, 3]])).sum())
    optimizer.step()
    assert not torch.equal(before, second.lm_head.weight)


def _normal_init(model: nn.Module) -> None:
    """The init litgpt's pretrain script applies after building the model (``initialize_weights``)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize(
    ("write", "name"),
    [
        (_normal_init, "embed.weight"),
        (lambda m: m.proj.reset_parameters(), "proj.weight"),
        (lambda m: m.norm.bias.detach().zero_(), "norm.bias"),
        (lambda m: torch.no_grad()(m.proj.bias.copy_)(torch.ones(10)), "proj.bias"),
        (lambda m: m.load_state_dict(Block().state_dict()), "embed.weight"),
    ],
)
def test_init_written_after_the_block_raises_naming_the_parameter(strategy, write, name):
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = Block()
    write(model)
    with pytest.raises(
        ValueError, match=rf"parameter '{name}' of Block.*changed in place after.*into the block"
    ):
        acc.setup(model)
    assert all(p.is_meta for p in model.parameters())  # nothing changed


def _override_reset(model: nn.Module) -> None:
    """litgpt's ``pretrain.py`` under FSDP: it sets each ``reset_parameters`` and leaves calling them to setup."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.reset_parameters = functools.partial(nn.init.normal_, m.weight, std=0.02)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_reset_parameters_set_after_the_block_raises_naming_it(strategy):
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = Block()
    _override_reset(model)
    with pytest.raises(ValueError, match=r"`embed.reset_parameters` of Block \(in Embedding\) was set after"):
        acc.setup(model)


def test_reset_parameters_set_and_called_inside_the_block_is_reproduced(acc):
    torch.manual_seed(4)
    eager = Block()
    _override_reset(eager)
    for m in eager.modules():
        if "reset_parameters" in m.__dict__:
            m.reset_parameters()
    torch.manual_seed(4)
    with acc.init_module(empty_init=True):
        model = Block()
        _override_reset(model)
        for m in model.modules():
            if "reset_parameters" in m.__dict__:
                m.reset_parameters()
    assert mismatches(eager, acc.setup(model)) == []


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_init_written_inside_the_block_after_construction_is_reproduced(strategy):
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    torch.manual_seed(5)
    eager = Block()
    _normal_init(eager)
    after_eager = torch.rand(3)
    torch.manual_seed(5)
    with acc.init_module(empty_init=True):
        model = Block()
        _normal_init(model)  # the fix the error gives: the script's init moved into the block
    assert torch.equal(torch.rand(3), after_eager)
    model = acc.setup(model)
    assert mismatches(eager, model) == []


def test_a_cast_after_the_block_is_not_an_init(acc):
    torch.manual_seed(2)
    eager = Block().to(torch.bfloat16)
    torch.manual_seed(2)
    with acc.init_module(empty_init=True):
        model = Block()
    model = acc.setup(model.to(torch.bfloat16))
    assert mismatches(eager, model) == []


def test_without_empty_init_parameters_are_real_on_the_device(acc):
    with acc.init_module():
        model = Block()
    assert all(p.device == acc.device and not p.is_meta for p in model.parameters())


def test_saving_a_model_still_on_meta_raises(acc, tmp_path):
    with acc.init_module(empty_init=True):
        model = Block()
    with pytest.raises(RuntimeError, match=r"still has meta parameters.*acc\.setup\(model\)"):
        acc.save(tmp_path / "ckpt.pt", {"model": model})


def test_the_recorder_is_gone_after_the_context(acc):
    with acc.init_module(empty_init=True):
        Block()
    assert not torch.empty(2).is_meta
    assert nn.Module.register_parameter.__module__ == "torch.nn.modules.module"
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_the_init_package_imports_nothing_above_it():
    """``minifabric/init`` sits below the strategies and the facade: it imports neither (only the
    bottom layer: private torch in ``_torch``, process-wide bookkeeping in ``process``)."""
    import ast
    from pathlib import Path

    import minifabric.init

    allowed = ("minifabric._torch", "minifabric.init", "minifabric.process")
    for path in Path(minifabric.init.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if names == ["minifabric"]:  # `from minifabric import process`: the module imported
                names = [f"minifabric.{a.name}" for a in node.names]
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("minifabric"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"
                assert not name.startswith("torch._") and ".._" not in name, f"{path.name} imports {name}"
                assert not any(
                    part.startswith("_") for part in name.split(".")[1:] if name.startswith("torch")
                ), f"{path.name} imports private torch {name}"
