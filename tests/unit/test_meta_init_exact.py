"""Meta-device init one step off the common path: exact, or a clear error naming the call.

Each model is built eagerly and inside ``init_module(empty_init=True)`` with the same seed; after
``setup`` every tensor is bitwise equal, and so is the random stream after construction.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests import meta_cases
from tests.init_styles import STYLES, mismatches


def _acc(strategy: str) -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    return acc


def _build_both(acc: Accelerator, build, seed: int = 0):
    torch.manual_seed(seed)
    eager = build()
    stream = torch.rand(8)
    torch.manual_seed(seed)
    with acc.init_module(empty_init=True):
        model = build()
    return eager, stream, model


@pytest.mark.parametrize("case", sorted(meta_cases.CASES))
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_off_path_init_equals_eager_construction(case: str, strategy: str) -> None:
    if strategy == "fsdp" and case in meta_cases.NON_CONTIGUOUS:
        pytest.skip("FSDP2 refuses non-contiguous parameters (eagerly built ones too)")
    acc = _acc(strategy)
    eager, stream, model = _build_both(acc, meta_cases.CASES[case])
    assert torch.equal(torch.rand(8), stream), "the random stream after construction differs from eager"
    assert mismatches(eager, acc.setup(model)) == []


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_real_tensors_read_by_init_are_captured_by_value(strategy: str) -> None:
    acc = _acc(strategy)
    saved = (meta_cases.SHARED.copy(), meta_cases.ReadsReal.SOURCE.clone())
    try:
        eager, _, model = _build_both(acc, meta_cases.ReadsReal)
        meta_cases.change_real_sources()  # after construction, before setup
        assert mismatches(eager, acc.setup(model)) == []
    finally:
        meta_cases.SHARED[:] = saved[0]
        meta_cases.ReadsReal.SOURCE.copy_(saved[1])


def test_spectral_norm_replay_is_linear_in_the_recorded_ops(monkeypatch) -> None:
    """15 power iterations read u and v back and forth: each recorded op runs a bounded number of times."""
    from minifabric.init import replay

    calls = []
    real_call = replay.call
    monkeypatch.setattr(replay, "call", lambda op, *a: calls.append(op) or real_call(op, *a))
    acc = _acc("single")
    eager, _, model = _build_both(acc, meta_cases.Spectral)
    assert mismatches(eager, acc.setup(model)) == []
    per_op: dict[int, int] = {}
    for op in calls:
        per_op[id(op)] = per_op.get(id(op), 0) + 1
    assert max(per_op.values()) <= 4, max(per_op.values())  # exponential before: thousands


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_pretrained_part_loaded_with_assign_is_kept(strategy: str) -> None:
    acc = _acc(strategy)
    torch.manual_seed(0)
    pretrained = STYLES["nanogpt"]()
    torch.manual_seed(1)
    eager = STYLES["nanogpt"]()
    torch.manual_seed(1)
    with acc.init_module(empty_init=True):
        model = STYLES["nanogpt"]()
    backbone = {k: v for k, v in pretrained.state_dict().items() if k.startswith("blocks.")}
    model.load_state_dict(backbone, strict=False, assign=True)
    model = acc.setup(model)
    different = mismatches(eager, model)
    assert different and all(name.startswith("blocks.") for name in different)  # the rest: eager values
    assert mismatches(pretrained.blocks, _inner(model).blocks) == []


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
@pytest.mark.parametrize("how", ["deepcopy", "averaged"])
def test_copies_of_a_meta_built_model_set_up_like_the_original(strategy: str, how: str) -> None:
    acc = _acc(strategy)
    eager, _, model = _build_both(acc, STYLES["hf"])
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        copied = torch.optim.swa_utils.AveragedModel(model)
    model, copied = acc.setup(model), acc.setup(copied)
    assert mismatches(eager, model) == []
    state = {k.removeprefix("module."): v for k, v in _states(copied).items() if k != "n_averaged"}
    assert state.keys() == _states(eager).keys()
    assert all(torch.equal(v, _states(eager)[k]) for k, v in state.items())


def _states(model: nn.Module) -> dict[str, torch.Tensor]:
    from tests.init_styles import full_state

    return full_state(model)


class _LazyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.LazyLinear(4)


class _NewEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Parameter(self.a.weight.new_empty(3))
        self.c = nn.Parameter(torch.empty_like(self.a.bias))
        nn.init.zeros_(self.c)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.kept = nn.Parameter(self.a.weight[self.a.weight > 0])  # shape depends on the values
        if self.a.bias.sum() > 0:  # a branch on the values
            nn.init.normal_(self.a.bias)


def test_lazy_modules_are_refused_at_construction_naming_the_fix() -> None:
    acc = _acc("single")
    with pytest.raises(
        ValueError, match=r"LazyLinear.*lazy parameter.*nn.Linear\(in_features, out_features\)"
    ):
        with acc.init_module(empty_init=True):
            _LazyModel()


def test_a_new_empty_parameter_never_written_is_refused_naming_it() -> None:
    acc = _acc("single")
    with acc.init_module(empty_init=True):
        model = _NewEmpty()
    with pytest.raises(ValueError, match=r"parameter 'b' of _NewEmpty.*never\s+initialized"):
        acc.setup(model)


def test_value_dependent_shapes_and_branches_are_recorded_exactly() -> None:
    acc = _acc("single")
    eager, stream, model = _build_both(acc, _DataDependent)
    assert torch.equal(torch.rand(8), stream)
    assert mismatches(eager, acc.setup(model)) == []


class _Unseen(nn.Module):
    """An init that minifabric cannot see: a helper that skips meta tensors, as some libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if not self.b.weight.is_meta:  # skipped on meta, so never recorded
            nn.init.constant_(self.b.weight, 0.5)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_the_self_check_finds_an_init_that_was_not_recorded(strategy: str) -> None:
    acc = _acc(strategy)
    with acc.init_module(empty_init=True, verify=True):
        model = _Unseen()
    with pytest.raises(RuntimeError, match=r"_Unseen\.b\.weight differs from eager.*empty_init=False"):
        acc.setup(model)


def test_the_self_check_passes_on_exact_models_and_reads_the_environment(monkeypatch) -> None:
    acc = _acc("fsdp")
    monkeypatch.setenv("MINIFABRIC_VERIFY_INIT", "1")
    for build in (*STYLES.values(), meta_cases.WrappedInit, meta_cases.Spectral):
        eager, _, model = _build_both(acc, build)
        assert mismatches(eager, acc.setup(model)) == []
    with acc.init_module(empty_init=True):
        model = _Unseen()
    with pytest.raises(RuntimeError, match="differs from eager"):
        acc.setup(model)


def test_init_module_accepts_the_fabric_form_and_checks_verify() -> None:
    acc = _acc("single")
    with acc.init_module(True):
        assert torch.empty(2).is_meta
    with acc.init_module(empty_init=False):
        pass
    with pytest.raises(ValueError, match=r"empty_init=True, verify=True"):
        with acc.init_module(verify=True):
            pass
    with pytest.raises(TypeError, match="verify must be"):
        with acc.init_module(empty_init=True, verify="yes"):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("family", ["vit", "modernbert", "dinov2"])
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_transformers_models_equal_eager_construction(family: str, strategy: str) -> None:
    """transformers wraps trunc_normal_ and friends while it initializes weights: recorded exactly."""
    pytest.importorskip("transformers")
    from tests.hf_tiny import build

    acc = _acc(strategy)
    eager, stream, model = _build_both(acc, lambda: build(family))
    assert torch.equal(torch.rand(8), stream), "the random stream after construction differs from eager"
    assert mismatches(eager, acc.setup(model)) == []


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def _plain_meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), _Scale(), nn.Linear(4, 2))


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_model_built_under_plain_meta_is_materialized_as_fabric_does(strategy: str) -> None:
    from lightning_fabric.utilities.init import _materialize_distributed_module

    acc = _acc(strategy)
    reference = _plain_meta_model()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="Parameter initialization incomplete.*_Scale"):
        _materialize_distributed_module(reference, torch.device("cpu"))
    model = _plain_meta_model()
    torch.manual_seed(0)
    with pytest.warns(
        UserWarning, match=r"Parameter initialization incomplete.*reset_parameters\(\).*_Scale"
    ):
        model = acc.setup(model)
    different = mismatches(reference, model)
    assert set(different) <= {"2.scale"}  # uninitialized memory on both sides; every reset module equal


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_plain_meta_model_keeps_a_part_loaded_with_assign(strategy: str) -> None:
    """Fine-tuning built under plain ``torch.device("meta")``: the loaded backbone is kept, the head reset."""
    acc = _acc(strategy)
    torch.manual_seed(0)
    pretrained = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model = _plain_meta_model()
    model.load_state_dict(
        {f"{k}": v.clone() for k, v in pretrained.state_dict().items()}, strict=False, assign=True
    )
    torch.manual_seed(1)
    head = nn.Linear(4, 2)  # what reset_parameters() draws first after the seed
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="Parameter initialization incomplete.*_Scale"):
        model = acc.setup(model)
    state = _states(model)
    for key, value in pretrained.state_dict().items():
        assert torch.equal(state[key], value), key
    assert torch.equal(state["3.weight"], head.weight) and torch.equal(state["3.bias"], head.bias)


def test_a_plain_meta_module_with_real_and_meta_tensors_keeps_the_real_ones_or_refuses() -> None:
    acc = _acc("single")
    model = _plain_meta_model()
    model[0].weight = nn.Parameter(torch.ones(4, 4))  # the bias stays on meta
    with pytest.raises(ValueError, match=r"`0.reset_parameters\(\)` \(Linear\) would overwrite '0.weight'"):
        acc.setup(model)
    assert torch.equal(model[0].weight, torch.ones(4, 4))  # refused before the write


class _Parent(nn.Module):
    """Its ``reset_parameters()`` initializes a child too (as many models' inits do)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.empty(3))
        self.child = nn.Linear(3, 3)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.pos)
        with torch.no_grad():
            self.child.weight.data.fill_(7.0)  # through .data: the same memory


def test_a_parent_reset_that_would_overwrite_a_loaded_child_is_refused_naming_both() -> None:
    acc = _acc("single")
    with torch.device("meta"):
        model = _Parent()
    model.child.load_state_dict({"weight": torch.ones(3, 3), "bias": torch.ones(3)}, assign=True)
    with pytest.raises(
        ValueError, match=r"`the model.reset_parameters\(\)` \(_Parent\) would overwrite 'child.weight'"
    ):
        acc.setup(model)
    assert torch.equal(model.child.weight, torch.ones(3, 3))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_plain_meta_model_keeps_its_tied_weights_tied(strategy: str) -> None:
    acc = _acc(strategy)
    with torch.device("meta"):
        model = _Tied()
    model = _inner(acc.setup(model))
    assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta


class _ParentAssigning(_Parent):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.pos)
        self.child.weight.data = torch.full((3, 3), 7.0)  # new memory under the same object


def test_a_reset_that_gives_a_loaded_tensor_new_memory_is_refused_and_setup_changes_nothing() -> None:
    acc = _acc("single")
    with torch.device("meta"):
        model = _ParentAssigning()
    model.child.load_state_dict({"weight": torch.ones(3, 3), "bias": torch.ones(3)}, assign=True)
    weight = model.child.weight
    with pytest.raises(ValueError, match=r"would overwrite 'child.weight' \(new memory in its place\)"):
        acc.setup(model)
    assert model.child.weight is weight and torch.equal(weight, torch.ones(3, 3))  # as before setup
    assert model.pos.is_meta  # and the meta tensors are meta again: a second setup cannot skip them


def test_after_a_refusal_the_model_is_as_before_and_setup_again_refuses() -> None:
    acc = _acc("single")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8))
    model[0].weight = nn.Parameter(torch.ones(4, 4))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"would overwrite '0\.weight'"):
            acc.setup(model)
        assert (
            model[0].bias.is_meta
            and model[1].weight.is_meta
            and torch.equal(model[0].weight, torch.ones(4, 4))
        )
    model[0].bias = nn.Parameter(torch.zeros(4))  # now the first layer is all real: kept, the second reset
    torch.manual_seed(0)
    reference = nn.Linear(4, 8)
    torch.manual_seed(0)
    model = _inner(acc.setup(model))
    assert torch.equal(model[0].weight, torch.ones(4, 4)) and torch.equal(model[1].weight, reference.weight)
