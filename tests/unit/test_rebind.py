"""Unit tests of the optimizer rebind (``minifabric.strategies.rebind``), without the facade.

``setup`` replaces parameter objects (materialization, sharding); an optimizer built before is
pointed at the new ones by qualified name, its state laid out like them. An optimizer never
passed to ``setup`` raises at its first ``step()``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from minifabric.init import materialize, meta_init_context
from minifabric.strategies.rebind import (
    OrphanWatch,
    SetupLedger,
    parameter_names,
    parameters_before,
    rebind_optimizer,
)


def _replace_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """What ``setup`` does to a model built on the CPU: new parameter objects, same names and values."""
    for sub in model.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                value = p.detach().clone().to(dtype or p.dtype)
                sub._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_groups_point_at_the_new_parameters_and_keep_their_options() -> None:
    model = _model()
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.01}],
        momentum=0.9,
    )
    names = parameter_names(model)
    _replace_parameters(model)
    rebind_optimizer(optimizer, names, model)
    assert [g["params"] for g in optimizer.param_groups] == [
        list(model[0].parameters()),
        list(model[2].parameters()),
    ]
    assert [(g["lr"], g["momentum"]) for g in optimizer.param_groups] == [(0.1, 0.9), (0.01, 0.9)]
    before = model[0].weight.detach().clone()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[0].weight)  # the step changes the model


def test_state_built_before_moves_to_the_new_parameter() -> None:
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.5)
    old = model[0].weight
    names = parameter_names(model)
    _replace_parameters(model)
    rebind_optimizer(optimizer, names, model)
    assert old not in optimizer.state
    assert torch.equal(optimizer.state[model[0].weight]["sum"], torch.full((4, 3), 0.5))


def test_an_optimizer_built_over_meta_parameters_is_rebound_after_materialize() -> None:
    with meta_init_context():
        model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = parameter_names(model)
    materialize(model)
    rebind_optimizer(optimizer, names, model)
    assert optimizer.param_groups[0]["params"] == [model.weight, model.bias]
    assert not any(p.is_meta for p in optimizer.param_groups[0]["params"])


def test_a_parameter_of_another_model_is_refused_before_any_change() -> None:
    model, other = _model(), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), other.weight], lr=0.1)
    names = parameter_names(model)
    params = list(optimizer.param_groups[0]["params"])
    _replace_parameters(model)
    with pytest.raises(
        ValueError, match=r"SGD holds 1 parameter\(s\) that are not parameters of the Sequential"
    ):
        rebind_optimizer(optimizer, names, model)
    assert optimizer.param_groups[0]["params"] == params


def test_state_that_cannot_be_laid_out_like_the_parameter_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model[0].weight]["odd"] = torch.zeros(7)
    names = parameter_names(model)
    _replace_parameters(model)
    with pytest.raises(RuntimeError, match=r"state 'odd' of shape \(7,\) .*Create the optimizer after setup"):
        rebind_optimizer(optimizer, names, model)


def test_state_in_another_dtype_than_the_new_parameter_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model[0].weight]["buf"] = torch.zeros(4, 3)
    names = parameter_names(model)
    _replace_parameters(model, torch.float64)  # as a precision setting would make them
    with pytest.raises(RuntimeError, match=r"state 'buf' in torch.float32 .*torch.float64"):
        rebind_optimizer(optimizer, names, model)


def test_names_ignore_the_checkpoint_wrapper() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = parameter_names(model)
    model[0] = checkpoint_wrapper(model[0])  # a parallelize_fn may add it: same parameters, longer names
    _replace_parameters(model)
    rebind_optimizer(optimizer, names, model)
    assert optimizer.param_groups[0]["params"] == list(model.parameters())


def test_the_ledger_rebinds_an_optimizer_to_the_model_it_was_built_over() -> None:
    ledger = SetupLedger()
    first, second = _model(), _model()
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    originals = [*first.parameters(), *second.parameters()]  # alive: their ids are not reused
    for model in (first, second):
        before = parameters_before(model)
        _replace_parameters(model)
        ledger.record(before, model, model)
    ledger.rebind(optimizer)
    assert optimizer.param_groups[0]["params"] == list(second.parameters())
    with pytest.raises(ValueError, match="SGD holds no parameter of the Sequential"):
        ledger.check_owned((optimizer,), first)
    del originals


def test_the_ledger_never_matches_a_new_parameter_by_the_id_of_a_freed_original() -> None:
    # Python reuses the ids of freed objects: a parameter made after setup may get the id of an
    # original that setup replaced and freed. Matching it by id would point its optimizer at the
    # set-up model's parameter of that name, silently.
    ledger = SetupLedger()
    model = _model()
    before = parameters_before(model)
    _replace_parameters(model)
    head = torch.nn.Parameter(torch.zeros(4, 4))
    name, _ = before.pop(next(iter(before)))
    before[id(head)] = (name, torch.nn.Parameter(torch.zeros(4, 4)))  # an original with head's id...
    ledger.record(before, model, model)
    del before  # ...freed after setup, as setup frees the originals it replaces
    optimizer = torch.optim.SGD([head], lr=0.1)
    ledger.rebind(optimizer)
    assert optimizer.param_groups[0]["params"][0] is head  # left as it is, not redirected


def test_an_orphaned_optimizer_raises_at_step_until_its_parameters_are_freed() -> None:
    watch = OrphanWatch()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with watch.watch(model):
            _replace_parameters(model)
        assert watch.active
        with pytest.raises(
            RuntimeError, match=r"holds 4 parameter\(s\) that `acc.setup` replaced \(0.weight"
        ):
            optimizer.step()
        del optimizer
        gc.collect()
        assert not watch.active  # the last replaced parameter is gone: the hook is removed
    finally:
        watch.close()


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_a_set_up_model_the_user_dropped_is_freed(strategy: str) -> None:
    import gc
    import weakref

    from minifabric import Accelerator

    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=1)
    acc.launch()
    model = _model()
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    refs = [weakref.ref(model.module), weakref.ref(next(model.parameters()))]
    del model, optimizer
    gc.collect()
    assert [ref() for ref in refs] == [None, None]  # the accelerator keeps no set-up model alive
    other = _model()
    other, _ = acc.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))  # and sets up the next
