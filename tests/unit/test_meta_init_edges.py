"""Meta-device init at its edges, in one process: zero-element parameters, the self-check and assigned
parts, records that follow their tensors into swapped-in modules.

The 2-rank tensor-parallel counterparts are in ``tests/distributed/test_model_parallel_meta.py``.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from minifabric.init import following_init_records, materialize, meta_init_context, recorded_places
from tests.init_styles import mismatches
from tests.meta_cases import Registers, SwappedLinear, fine_tune_with_verify


def _acc(strategy: str) -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    return acc


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_zero_element_parameter_never_written_is_set_up(strategy: str) -> None:
    acc = _acc(strategy)
    torch.manual_seed(0)
    eager = Registers()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = Registers()
    model = acc.setup(model)
    inner = getattr(model, "module", model)
    assert inner.storage_tokens.shape == (1, 0, 8) and inner.prompts.shape == (0,)
    assert not inner.storage_tokens.is_meta
    assert mismatches(eager.proj, inner.proj) == []


def test_a_parameter_with_elements_never_written_is_still_refused() -> None:
    acc = _acc("single")
    with acc.init_module(empty_init=True):
        model = Registers(n_storage_tokens=0)
        model.scale = nn.Parameter(torch.empty(3))
    with pytest.raises(ValueError, match=r"parameter 'scale' of Registers .*never initialized"):
        acc.setup(model)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_the_self_check_keeps_a_part_loaded_with_assign(strategy: str) -> None:
    """The contract keeps such a part; the self-check compares only what construction made."""
    pretrained, eager, model = fine_tune_with_verify(_acc(strategy))
    inner = getattr(model, "module", model)
    assert mismatches(pretrained, inner.backbone) == []
    assert mismatches(eager.head, inner.head) == []


_COUNTER = itertools.count()


class Counted(nn.Module):
    """A buffer computed in ``__init__`` from state outside torch: a second build gives another value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("built", torch.tensor([float(next(_COUNTER))]))


def test_the_self_check_still_compares_real_tensors_that_construction_made() -> None:
    acc = _acc("single")
    with acc.init_module(empty_init=True, verify=True):
        model = Counted()
    with pytest.raises(RuntimeError, match=r"Counted\.built differs from eager"):
        acc.setup(model)


def test_a_record_follows_its_parameter_into_a_module_swapped_in() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    torch.manual_seed(0)
    with meta_init_context():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = copy.deepcopy(model)  # a copy's tensors are known by their modules only, until the swap
    with following_init_records(recorded_places(model)):
        model[0] = SwappedLinear.from_float(model[0])
        model[1].weight = nn.Parameter(torch.empty(2, 4, device="meta"))  # a new tensor: no record
    with pytest.raises(
        ValueError, match=r"parameter '1\.weight' of Sequential \(in Linear\).*after swap ran"
    ):
        recorded_places(model, rebuilt_by="swap")
    model[1].weight = eager[1].weight  # a real tensor put in: kept
    materialize(model, recorded_places(model, rebuilt_by="swap"))
    assert isinstance(model[0], SwappedLinear)
    assert mismatches(eager, model) == []


def _model_parallel(fn) -> Accelerator:
    from minifabric import ModelParallelStrategy

    acc = Accelerator(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(fn, 1, 1))
    acc.launch()
    return acc


def _halved_by_hand(model: nn.Module, mesh) -> nn.Module:
    """A DTensor of the weight's shape but other values, made by hand (not by ``parallelize_module``)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    model[1].weight = nn.Parameter(distribute_tensor(model[1].weight.detach() * 0.5, mesh["tensor_parallel"], [Replicate()]))
    return model


def _planned(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "1": RowwiseParallel()})


def test_a_dtensor_made_by_hand_in_parallelize_fn_does_not_take_over_the_record() -> None:
    """Only a DTensor registered by ``parallelize_module`` (inside ``distribute_module``) is the old
    parameter laid out anew; one of the same shape made by hand may hold other values: refused."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torch.manual_seed(0)
    acc = _model_parallel(_planned)
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert mismatches(eager, acc.setup(model).module) == []

    acc = _model_parallel(_halved_by_hand)
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameter '1\.weight' .*after parallelize_fn '_halved_by_hand' ran"):
        acc.setup(model)


class _WithScale(nn.Linear):
    """A swap whose new module keeps a buffer of its own constructor on the meta device."""

    @classmethod
    def from_float(cls, mod: nn.Linear) -> _WithScale:
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
            new.register_buffer("amax", torch.zeros(1))
        new.weight, new.bias = mod.weight, mod.bias
        return new


def _swap_with_scale(model: nn.Module, mesh) -> nn.Module:
    model[0] = _WithScale.from_float(model[0])
    return model


def test_a_meta_tensor_parallelize_fn_leaves_in_a_plain_meta_model_is_refused() -> None:
    """Plain ``torch.device("meta")`` is materialized before the function: what it leaves on meta is named."""
    acc = _model_parallel(_swap_with_scale)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"buffer '0\.amax' of Sequential \(in _WithScale\).*after parallelize_fn"):
        acc.setup(model)


class _SkipsMeta(nn.Module):
    """An init the recording cannot see: it skips meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        if not self.fc.weight.is_meta:
            nn.init.constant_(self.fc.weight, 0.5)


class _Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_the_self_check_runs_when_parallelize_fn_returns_a_wrapper() -> None:
    acc = _model_parallel(lambda model, mesh: _Holder(model))
    with acc.init_module(empty_init=True, verify=True):
        model = _SkipsMeta()
    with pytest.raises(RuntimeError, match=r"_SkipsMeta\.fc\.weight differs from eager"):
        acc.setup(model)

    acc = _model_parallel(lambda model, mesh: copy.deepcopy(model))  # holds no module that was built
    with acc.init_module(empty_init=True, verify=True):
        model = _SkipsMeta()
    with pytest.warns(UserWarning, match=r"does not hold the _SkipsMeta .* set up unchecked"):
        acc.setup(model)


def _zero_head(model: nn.Module, mesh) -> nn.Module:
    nn.init.zeros_(model[1].weight)  # does nothing on meta; eager construction gets zeros
    return model


def _plan_then_zero_head(model: nn.Module, mesh) -> nn.Module:
    return _zero_head(_planned(model, mesh), mesh)


def _shard_then_zero_head(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[1], mesh=mesh["data_parallel"])
    return _zero_head(model, mesh)  # writes the sharded parameter that `fully_shard` made


@pytest.mark.parametrize("fn", [_zero_head, _plan_then_zero_head, _shard_then_zero_head])
def test_an_init_inside_parallelize_fn_is_refused(fn) -> None:
    acc = _model_parallel(fn)
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'1\.weight' .*changed in place.*parallelize_fn"):
        acc.setup(model)


def _transpose_head(model: nn.Module, mesh) -> nn.Module:
    model[1].weight.data = model[1].weight.data.t().contiguous()  # same shape, other values
    return model


def test_data_replaced_inside_parallelize_fn_is_refused_and_a_dtype_conversion_is_not() -> None:
    acc = _model_parallel(_transpose_head)
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'1\.weight' .*its `\.data` replaced"):
        acc.setup(model)

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    torch.manual_seed(0)
    acc = _model_parallel(lambda model, mesh: _planned(model.to(torch.bfloat16), mesh))
    with acc.init_module(empty_init=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert mismatches(eager, acc.setup(model).module) == []


class BuildsAPartInItsOwnBlock(nn.Module):
    """A model whose ``__init__`` enters ``init_module(empty_init=True)`` itself, for one part."""

    def __init__(self, acc: Accelerator) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        with acc.init_module(empty_init=True):
            self.b = nn.Linear(3, 3)


def test_the_self_check_rebuilds_a_model_that_enters_init_module_itself() -> None:
    """The eager rebuild builds every part eagerly, the one built in the inner block too."""
    acc = _acc("single")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    torch.manual_seed(0)
    with acc.init_module(empty_init=True, verify=True):
        model = BuildsAPartInItsOwnBlock(acc)
    model = acc.setup(model)
    assert mismatches(reference[0], model.a) == [] and mismatches(reference[1], model.b) == []


class ForeachScaled(nn.Module):
    """Writes its weight with a call that is not an in-place method (``torch._foreach_mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))
        nn.init.normal_(self.w)
        with torch.no_grad():
            torch._foreach_mul_([self.w], 2.0)


def test_a_write_by_a_call_that_is_not_an_in_place_method_is_refused_at_setup_naming_it() -> None:
    """Before, the write was lost: setup gave the weight without it."""
    with meta_init_context():
        model = ForeachScaled()
    with pytest.raises(ValueError, match=r"`_foreach_mul_` writes into it"):
        materialize(model)


class GradModeInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))
        self.w.normal_()  # no torch.no_grad(): eager construction raises


def test_an_in_place_init_of_a_parameter_outside_no_grad_raises_as_in_eager_construction() -> None:
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as eager:
        GradModeInit()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as meta, meta_init_context():
        GradModeInit()
    assert str(meta.value) == str(eager.value)
