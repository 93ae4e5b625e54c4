"""The fault-tolerance component: the null object's hooks change nothing; the factory picks and refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from minifabric import Accelerator, FaultTolerance, FSDPStrategy
from minifabric.strategies.ft import (
    NoFaultTolerance,
    ReplicaGroupComponent,
    TorchFTFaultTolerance,
    build_fault_tolerance,
)
from minifabric.strategies.ft.fsdp_gradients import FSDPGradients
from tests.unit.test_fault_tolerance import quorum_manager  # noqa: F401 (a fixture)


class _Untouchable:
    """Raises on any attribute read: a hook that reads it did something."""

    def __getattr__(self, name):
        raise AssertionError(f"the hook read .{name}")


def _hooks(module: torch.nn.Module) -> list[int]:
    return [
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules()
    ] + [len(p._backward_hooks or {}) for p in module.parameters()]


def test_the_null_object_hooks_leave_everything_as_it_was(acc):
    ft = NoFaultTolerance()
    assert not ft.enabled and ft.replica_group is None and ft.writes_checkpoints
    ft.on_setup(_Untouchable())  # reads nothing of the strategy (no port chosen, no torchft)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = acc.setup_dataloaders(DataLoader(torch.arange(6), batch_size=2))
    before = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(optimizer.state_dict()),
        scheduler.state_dict(),
        loader.state_dict(),
        _hooks(model),
    )
    ft.on_module(model)
    ft.on_optimizer(optimizer)
    ft.on_scheduler(scheduler)
    ft.on_dataloader(loader)
    ft.before_forward()
    after = (model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), loader.state_dict(), _hooks(model))
    assert after[2:] == before[2:]
    assert all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values(), strict=True))
    assert repr(after[1]) == repr(before[1])
    assert loader._before_batch == []  # no step starts before a batch
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    kwargs = {"num_replicas": 4, "rank": 3}
    assert ft.sampler_kwargs(kwargs) == {"num_replicas": 4, "rank": 3}
    ft.teardown()


def test_the_null_object_steps_once_with_any_closure_and_returns_the_result():
    ft = NoFaultTolerance()
    calls = []

    def step():
        calls.append("step")
        return "loss"

    assert ft.optimizer_step(_Untouchable(), {"closure": lambda: 1.0}, step) == "loss"
    assert calls == ["step"]


def test_the_factory_returns_the_null_object_without_settings_and_torchft_with_them():
    assert isinstance(build_fault_tolerance(None, FSDPGradients()), NoFaultTolerance)
    config = FaultTolerance(replica_group_id=1, num_replica_groups=3)
    gradients = FSDPGradients()
    ft = build_fault_tolerance(config, gradients)
    assert isinstance(ft, TorchFTFaultTolerance) and ft.enabled
    assert ft.config is config and ft.gradients is gradients
    # before the run starts: no replica group, this group may write, the data is split over the job
    assert ft.replica_group is None and ft.writes_checkpoints
    assert ft.sampler_kwargs({"num_replicas": 2, "rank": 1}) == {"num_replicas": 6, "rank": 3}


@pytest.mark.parametrize("config", [{"replica_group_id": 0}, "ft", 0, FaultTolerance])
def test_the_factory_refuses_what_is_not_fault_tolerance_settings(config):
    with pytest.raises(TypeError, match=r"fault_tolerance must be a minifabric\.FaultTolerance, got"):
        build_fault_tolerance(config, FSDPGradients())


def test_bad_settings_are_refused_before_the_factory_with_the_settings_message():
    with pytest.raises(ValueError, match="must be below num_replica_groups=2"):
        build_fault_tolerance(FaultTolerance(replica_group_id=2, num_replica_groups=2), FSDPGradients())


def test_a_component_must_implement_every_hook():
    class Partial(ReplicaGroupComponent):
        def before_forward(self) -> None:
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert issubclass(NoFaultTolerance, ReplicaGroupComponent)
    assert issubclass(TorchFTFaultTolerance, ReplicaGroupComponent)


def test_fsdp_strategy_holds_the_component_the_factory_built():
    plain = FSDPStrategy()
    assert isinstance(plain.ft, NoFaultTolerance) and plain.replica_group is None
    ft = FaultTolerance(replica_group_id=0, num_replica_groups=2)
    strategy = FSDPStrategy(fault_tolerance=ft)
    assert isinstance(strategy.ft, TorchFTFaultTolerance) and strategy.ft.config is ft
    assert isinstance(strategy.ft.gradients, FSDPGradients)
    assert strategy.fault_tolerance is ft and strategy.replica_group is None


def test_a_launched_fsdp_run_without_fault_tolerance_trains_as_before():
    """The null object's hooks run on every call; the loop steps every time (nothing to commit)."""
    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(), devices=1)
    acc.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        acc.backward(model(torch.ones(2, 4)).sum())
        assert optimizer.step() is None
        optimizer.zero_grad()
        reference(torch.ones(2, 4)).sum().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert acc.strategy.writes_checkpoints and acc.strategy.replica_group is None
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b)


def test_fault_tolerance_set_on_the_strategy_before_launch_is_what_runs(quorum_manager):  # noqa: F811
    """Assigning ``strategy.fault_tolerance`` before the run starts switches it on (or off), as the
    constructor argument does: never a strategy that reports settings it does not run."""
    ft = FaultTolerance(replica_group_id=1, num_replica_groups=2)
    strategy = FSDPStrategy()
    strategy.fault_tolerance = ft
    assert strategy.fault_tolerance is ft and isinstance(strategy.ft, TorchFTFaultTolerance)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=1)
    acc.launch()
    assert acc.strategy.replica_group is not None
    with pytest.raises(RuntimeError, match=r"fault_tolerance cannot change once the run started"):
        strategy.fault_tolerance = None
    assert strategy.fault_tolerance is ft and acc.strategy.replica_group is not None
    acc.strategy.replica_group.shutdown()
    off = FSDPStrategy(fault_tolerance=ft)
    off.fault_tolerance = None
    assert off.fault_tolerance is None and isinstance(off.ft, NoFaultTolerance)
    assert off.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(TypeError, match=r"fault_tolerance must be a minifabric\.FaultTolerance"):
        off.fault_tolerance = {"replica_group_id": 0}
    assert off.fault_tolerance is None and isinstance(off.ft, NoFaultTolerance)
