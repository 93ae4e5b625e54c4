"""An optimizer left holding parameters that ``setup`` replaced raises at ``step()``, and only it."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
from torch import nn

from minifabric import Accelerator

FIX = r"model, optimizer = acc\.setup\(model, optimizer\)"


def _meta_model(acc: Accelerator) -> nn.Module:
    with acc.init_module(empty_init=True):  # setup materializes new parameters
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


@pytest.fixture
def acc() -> Accelerator:
    accelerator = Accelerator(accelerator="cpu", devices=1)
    accelerator.launch()
    return accelerator


def test_a_stale_optimizer_raises_with_the_fix_and_changes_nothing(acc):
    model = _meta_model(acc)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = acc.setup(model)
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=FIX) as info:
        optimizer.step()
    assert "0.weight" in str(info.value)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_setting_the_optimizer_up_later_removes_the_check(acc):
    model = _meta_model(acc)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = acc.setup_module(model)
    assert acc._orphans.active
    optimizer = acc.setup_optimizers(optimizer)
    assert not acc._orphans.active  # the rebound optimizer released the old parameters
    before = model.module[0].weight.detach().clone()
    acc.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    assert not torch.equal(before, model.module[0].weight)


def test_optimizers_set_up_with_the_model_never_register_the_hook(acc):
    model = _meta_model(acc)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters()))
    assert not acc._orphans.active
    acc.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()


def test_other_optimizers_step_while_a_stale_one_exists(acc):
    model = _meta_model(acc)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: F841 (kept alive on purpose)
    model = acc.setup(model)
    assert acc._orphans.active
    unrelated = nn.Linear(2, 2)
    fresh = torch.optim.SGD([*model.parameters(), *unrelated.parameters()], lr=0.1)
    (model(torch.randn(2, 4)).sum() + unrelated(torch.randn(1, 2)).sum()).backward()
    before = unrelated.weight.detach().clone()
    for _ in range(2):
        fresh.step()  # checked once, then remembered as clean
    assert not torch.equal(before, unrelated.weight)


def test_dropping_the_stale_optimizer_or_the_accelerator_removes_the_hook(acc):
    model = _meta_model(acc)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    acc.setup(model)
    assert acc._orphans.active
    del stale
    gc.collect()
    assert not acc._orphans.active

    other = Accelerator(accelerator="cpu", devices=1)
    model = _meta_model(other)
    kept = torch.optim.SGD(model.parameters(), lr=0.1)
    other.setup(model)
    watch = other._orphans
    assert watch.active
    del other
    gc.collect()
    assert not watch.active  # the hook does not outlive its Accelerator
    kept.step()  # nothing is watching any more


def test_eager_single_device_keeps_the_parameters_so_an_old_optimizer_still_trains(acc):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = acc.setup(model)
    assert not acc._orphans.active
    before = model.weight.detach().clone()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.weight)


def test_the_accelerator_still_pickles_for_spawned_processes(acc):
    model = _meta_model(acc)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: F841 (kept alive on purpose)
    acc.setup(model)
    assert acc._orphans.active
    copy = pickle.loads(pickle.dumps(acc._orphans))
    assert not copy.active
    pickle.dumps(Accelerator(accelerator="cpu", devices=2))  # what acc.launch(fn) sends to each process
