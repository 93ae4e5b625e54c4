"""Fault tolerance against training loops as users write them (one process, torchft's manager stood in)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from minifabric import Accelerator, FaultTolerance, FSDPStrategy
from tests.unit.test_fault_tolerance import _Logged, quorum_manager  # noqa: F401 (a fixture)


def _launched(**settings):
    """A launched one-process Accelerator: FSDP, "32-true", replica group 1 of 2 (on the stand-in)."""
    ft = FaultTolerance(replica_group_id=1, num_replica_groups=2, **settings)
    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(fault_tolerance=ft), devices=1)
    acc.launch()
    return acc


def test_a_closure_is_refused_before_the_step_commits(quorum_manager):  # noqa: F811
    acc = _launched()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model, optimizer = acc.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2))
    loader = acc.setup_dataloaders(DataLoader(_Logged(quorum_manager.log), batch_size=2))
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        acc.backward(loss)
        return loss

    next(iter(loader))  # the step starts when its batch is drawn
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(closure\) is not supported with fault_tolerance"):
        optimizer.step(closure)
    assert quorum_manager.step == 0  # nothing committed
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_an_optimizer_of_the_model_that_was_not_set_up_is_refused_at_its_first_step(quorum_manager):  # noqa: F811
    acc = _launched()
    model = acc.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    raw = torch.optim.SGD(model.parameters(), lr=0.1)  # built after setup, never set up
    loader = acc.setup_dataloaders(DataLoader(_Logged(quorum_manager.log), batch_size=2))
    before = [p.detach().clone() for p in model.parameters()]
    next(iter(loader))
    acc.backward(model(torch.ones(2, 4)).sum())
    with pytest.raises(RuntimeError, match=r"optimizer = acc\.setup_optimizers\(optimizer\)"):
        raw.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer = acc.setup_optimizers(raw)  # set up, the same optimizer steps and commits
    optimizer.step()
    assert quorum_manager.step == 1
    other = torch.nn.Linear(2, 2)  # an optimizer of other parameters is not concerned
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    acc.strategy.replica_group.shutdown()


def test_an_optimizer_of_a_model_that_was_not_set_up_is_refused_at_setup(quorum_manager):  # noqa: F811
    acc = _launched()
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)  # the head is never set up
    body = acc.setup(body)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds 2 parameter\(s\) of no model set up .*\(1, 4\), \(1,\)"):
        acc.setup_optimizers(optimizer)
    assert acc.strategy.replica_group._optimizers == []  # nothing was watched
    head = acc.setup(head)
    acc.setup_optimizers(torch.optim.SGD(head.parameters(), lr=0.1))  # set up, it is accepted
    acc.strategy.replica_group.shutdown()


def test_a_loader_with_a_sampler_of_its_own_is_refused_at_setup(quorum_manager):  # noqa: F811
    """It could not take the live groups' position: a group rejoining mid-epoch raised at its first batch."""
    acc = _launched()
    with pytest.raises(ValueError, match=r"sampler of your own \(SequentialSampler\).*use_distributed_sampler=True"):
        acc.setup_dataloaders(DataLoader(torch.arange(10), batch_size=2), use_distributed_sampler=False)
    assert list(acc.strategy.replica_group._objects) == ["minifabric.replica_groups", "minifabric.precision"]
    acc.setup_dataloaders(DataLoader(torch.arange(10), batch_size=2))  # split and positioned: accepted
    acc.strategy.replica_group.shutdown()


def test_every_rank_asks_as_often_before_it_gives_up_however_long_its_quorums_take(
    quorum_manager,  # noqa: F811
    monkeypatch,
):
    """Each quorum waits for all ranks of the group: a rank that asked once more than another would hang."""
    import time

    from tests.unit.test_fault_tolerance import _replica_group

    def asked(seconds_per_quorum: float) -> int:
        clock = [0.0]
        start = quorum_manager.start_quorum

        def slow_quorum() -> None:  # this rank's quorums return late (it reached them later)
            clock[0] += seconds_per_quorum
            start()

        with monkeypatch.context() as patch:
            patch.setattr(time, "monotonic", lambda: clock[0])
            patch.setattr(time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
            patch.setattr(quorum_manager, "start_quorum", slow_quorum)
            quorum_manager.log.clear()
            group = _replica_group(min_replica_groups=2, quorum_timeout=3)
            with pytest.raises(RuntimeError, match=r"min_replica_groups=2"):
                group.begin_step()
        return quorum_manager.log.count("quorum")

    assert asked(0.0) == asked(0.7) > 1


def test_a_group_with_another_precision_is_refused_at_its_heal(quorum_manager):  # noqa: F811
    """A "16-mixed" group healing from a "32-true" one kept its own loss scale and averaged scaled gradients."""
    from tests.unit.test_fault_tolerance import _16_mixed_replica_group

    acc = _16_mixed_replica_group()
    group = acc.strategy.replica_group
    live = group._state()
    live["objects"]["minifabric.precision"] = {"name": "32-true", "state": {}}  # as a "32-true" group sends it
    live["objects"]["minifabric.replica_groups"]["id"] = 0
    quorum_manager.heal = live
    with pytest.raises(RuntimeError, match=r"precision='32-true', this group with '16-mixed'.*precision='32-true'"):
        group.begin_step()
    assert acc.precision.scaler.get_scale() == 65536.0
    group.shutdown()


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        ({"id": 0, "groups": 3}, r"num_replica_groups=3, this group with 2"),
        ({"id": 1, "groups": 2}, r"Two replica groups run with replica_group_id=1"),
    ],
)
def test_groups_that_would_split_the_data_differently_are_refused_at_the_heal(quorum_manager, sent, message):  # noqa: F811
    """Two groups with one id read the same part of the data; other group counts split it otherwise."""
    acc = _launched()
    group = acc.strategy.replica_group
    live = group._state()
    live["objects"]["minifabric.replica_groups"] = sent
    quorum_manager.heal = live
    with pytest.raises(RuntimeError, match=message):
        group.begin_step()
    group.shutdown()


def test_a_group_with_another_optimizer_is_refused_at_the_heal_naming_both(quorum_manager):  # noqa: F811
    """An AdamW state was loaded into SGD: its hyper-parameters replaced SGD's (no 'momentum' left)."""
    from minifabric.strategies.ft.heal import module_state

    acc = _launched()
    model = torch.nn.Linear(4, 1)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    group = acc.strategy.replica_group
    group._module_views = [module_state(m) for m in group._modules]  # as `begin_step` takes them
    live = group._state()
    live["objects"]["minifabric.replica_groups"]["id"] = 0
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1)) for _ in range(2)])
    live["optimizers"] = [{**adamw.state_dict(), "minifabric.type": "AdamW"}]  # as an AdamW group sends it
    quorum_manager.heal = live
    with pytest.raises(RuntimeError, match=r"sent the state of a AdamW; this group steps a SGD"):
        model(torch.ones(2, 4))
    assert optimizer.param_groups[0]["momentum"] == 0.9
    group.shutdown()
