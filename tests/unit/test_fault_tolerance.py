"""FaultTolerance settings: validation at the public call, the data split across groups, lazy torchft."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

from minifabric import Accelerator, FaultTolerance, FSDPStrategy
from tests.helpers import REPO


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_group_id": 2, "num_replica_groups": 2}, "must be below num_replica_groups=2"),
        ({"replica_group_id": -1, "num_replica_groups": 2}, "replica_group_id=-1 must be an integer >= 0"),
        ({"replica_group_id": 0, "num_replica_groups": 0}, "num_replica_groups=0 must be an integer >= 1"),
        ({"replica_group_id": 0, "num_replica_groups": True}, "num_replica_groups=True"),
        (
            {"replica_group_id": 0, "num_replica_groups": 2, "min_replica_groups": 3},
            "no step could ever commit",
        ),
        ({"replica_group_id": 0, "num_replica_groups": 2, "lighthouse": "host:29510"}, "is not an address"),
        ({"replica_group_id": 0, "num_replica_groups": 2, "timeout": 0}, "timeout=0 must be a positive"),
        ({"replica_group_id": 0, "num_replica_groups": 2, "quorum_timeout": "1"}, "quorum_timeout='1'"),
        (
            {"replica_group_id": 0, "num_replica_groups": 2, "overlap_quorum": 1},
            "overlap_quorum=1 must be True or False",
        ),
    ],
)
def test_bad_settings_raise_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        FaultTolerance(**kwargs)


def test_timeouts_become_timedeltas_and_the_lighthouse_comes_from_the_environment(monkeypatch):
    ft = FaultTolerance(replica_group_id=1, num_replica_groups=2, timeout=5)
    assert ft.timeout == timedelta(seconds=5) and ft.quorum_timeout == timedelta(seconds=60)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        ft.lighthouse_address()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    assert ft.lighthouse_address() == "http://lh:29510"
    explicit = FaultTolerance(replica_group_id=0, num_replica_groups=2, lighthouse="http://other:1")
    assert explicit.lighthouse_address() == "http://other:1"


def test_the_strategy_takes_only_fault_tolerance_settings():
    with pytest.raises(TypeError, match=r"fault_tolerance must be a minifabric\.FaultTolerance"):
        FSDPStrategy(fault_tolerance={"replica_group_id": 0})


def test_each_rank_of_each_group_reads_its_own_part_of_the_data():
    ft = FaultTolerance(replica_group_id=1, num_replica_groups=3)
    strategy = FSDPStrategy(fault_tolerance=ft)
    strategy.environment.set_world_size(2)
    strategy.environment.set_global_rank(1)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 3}
    plain = FSDPStrategy()
    plain.environment.set_world_size(2)
    plain.environment.set_global_rank(1)
    assert plain.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    assert plain.writes_checkpoints


def test_minifabric_imports_without_torchft_and_says_how_to_install_it():
    code = (
        "import sys; sys.modules['torchft'] = None\n"  # as if torchft were not installed
        "import minifabric\n"
        "from minifabric import FaultTolerance, FSDPStrategy\n"
        "FSDPStrategy(fault_tolerance=FaultTolerance(replica_group_id=0, num_replica_groups=2))\n"
        "from minifabric.strategies.ft.quorum import import_torchft\n"
        "try:\n"
        "    import_torchft()\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert "pip install 'minifabric[ft]'" in result.stdout, result.stderr


class _Manager:
    """Stands in for torchft's Manager: records when each all-reduce starts and is waited for."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self._healing = False  # a live group's state is waiting to be applied (overlap_quorum)

    def _apply_pending_state_dict(self) -> None:
        self.log.append("heal")

    def allreduce(self, tensor, reduce_op):
        name = f"ar{sum(entry.startswith('start') for entry in self.log)}"
        self.log.append(f"start {name}")
        manager = self

        class Work:
            def wait(self) -> None:
                manager.log.append(f"wait {name}")

        return Work()


def _group_in_step():
    from minifabric.strategies.ft.fsdp_gradients import FSDPGradients
    from minifabric.strategies.ft.replica_group import ReplicaGroup

    group = ReplicaGroup.__new__(ReplicaGroup)  # without torchft: only the all-reduce bookkeeping
    group._in_step, group._pending, group._manager = True, [], _Manager()
    group._gradients = FSDPGradients()
    return group


def test_cross_group_all_reduces_overlap_backward_and_are_all_waited_for_before_it_returns():
    import torch

    group = _group_in_step()
    x = torch.ones(3, requires_grad=True)
    fp32 = torch.nn.Parameter(torch.ones(2))
    with_grad = torch.nn.Parameter(torch.ones(2))
    with_grad.grad = torch.zeros(2)

    def unit(params, dtype):  # what FSDP2's all-reduce hook sees for one sharding unit
        return lambda grad: group._average_across_groups(params, torch.zeros(2, dtype=dtype))

    y = x * 2
    y.register_hook(unit([fp32], torch.float32))  # deferred: the buffer becomes the gradients as is
    z = y * 3
    z.register_hook(unit([with_grad], torch.float32))  # FSDP adds it into an existing gradient: wait now
    w = z * 4
    w.register_hook(unit([fp32], torch.bfloat16))  # FSDP casts it: wait now
    v = w * 5
    v.register_hook(unit([fp32], torch.float32))  # deferred
    v.sum().backward()
    group._manager.log.append("backward returned")
    assert group._manager.log == [
        "start ar0",  # v's unit (backward runs from the loss down)
        "start ar1",
        "wait ar1",
        "start ar2",
        "wait ar2",
        "start ar3",
        "wait ar0",  # the deferred ones, once, when the backward pass ends
        "wait ar3",
        "backward returned",
    ]
    assert group._pending == []
    group._average_across_groups([fp32], torch.zeros(2))  # outside backward: waited at once
    assert group._manager.log[-2:] == ["start ar4", "wait ar4"]


def test_a_heal_still_pending_when_backward_ends_is_applied_before_backward_returns():
    """overlap_quorum: a group that was behind takes the live state before a clip unscales."""
    import torch

    group = _group_in_step()
    group._manager._healing = True  # the quorum said: heal (torchft would wait for should_commit)
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    for dtype in (torch.float16, torch.float32):  # one unit waited for at once, one deferred
        y.register_hook(
            lambda grad, dtype=dtype: group._average_across_groups([], torch.zeros(2, dtype=dtype))
        )
    y.sum().backward()
    group._manager.log.append("backward returned")
    assert group._manager.log == [
        "start ar0",
        "wait ar0",
        "start ar1",
        "wait ar1",
        "heal",
        "backward returned",
    ]
    assert group._manager._healing is False


class _QuorumManager:
    """Stands in for torchft's Manager in one process: quorums (each may heal), one group's steps."""

    def __init__(self, participants=(1,), heal=None) -> None:
        self.log: list[str] = []
        self.participants = list(participants)  # per quorum; the last one repeats
        self.heal = heal  # a state the first quorum loads, as a live group would send it
        self.group = None
        self.step = 0
        self.live = 0
        self.commits: list[bool] = []  # what should_commit answers, step by step (then True)
        self._healing = False

    def start_quorum(self) -> None:
        self.log.append("quorum")
        self.live = self.participants.pop(0) if len(self.participants) > 1 else self.participants[0]
        if self.heal is not None:
            state, self.heal = self.heal, None
            self.group._load(state)

    def wait_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.live

    def is_participating(self) -> bool:
        return True

    def allreduce(self, tensor, reduce_op):
        class Work:
            def wait(self) -> None:
                pass

        return Work()

    def should_commit(self) -> bool:
        commit = self.commits.pop(0) if self.commits else True
        self.step += commit
        return commit

    def shutdown(self, wait: bool) -> None:
        pass


@pytest.fixture
def quorum_manager(monkeypatch):
    """Every ReplicaGroup built in the test gets this manager instead of torchft's."""
    from minifabric.strategies.ft import quorum

    manager = _QuorumManager()

    def make(group, store_address):
        manager.group = group
        return manager

    monkeypatch.setattr(quorum, "make_manager", make)
    return manager


def _replica_group(**settings):
    from minifabric.strategies.ft.fsdp_gradients import FSDPGradients
    from minifabric.strategies.ft.replica_group import ReplicaGroup

    ft = FaultTolerance(replica_group_id=0, num_replica_groups=2, **settings)
    return ReplicaGroup(
        ft, group_rank=0, group_size=1, store_address=("localhost", 0), gradients=FSDPGradients()
    )


class _Logged:
    """A dataset that logs every sample read into the manager's log (to see when data is drawn)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        self.log.append(f"read {index}")
        return index


def test_a_rejoining_group_heals_before_it_draws_its_first_batch(acc, quorum_manager):
    import torch
    from torch.utils.data import DataLoader

    live = acc.setup_dataloaders(DataLoader(torch.arange(10), batch_size=2))
    batches = iter(live)
    next(batches), next(batches), next(batches)
    position = live.state_dict()  # where the live group is: 3 batches into the epoch
    group = _replica_group()
    loader = acc.setup_dataloaders(DataLoader(_Logged(quorum_manager.log), batch_size=2))
    group.watch_dataloader(loader)
    live_group = {"id": 1, "groups": 2}  # the live group's settings
    quorum_manager.heal = {
        "modules": [],
        "optimizers": [],
        "objects": {"minifabric.replica_groups": live_group, "minifabric.dataloader0": position},
    }
    first = next(iter(loader))
    assert first.tolist() == [6, 7]  # the live group's next batch, not the start of the epoch
    assert quorum_manager.log == ["quorum", "read 6", "read 7"]  # nothing read before the heal
    assert group.healed_at == [0]


def test_with_min_replica_groups_the_group_waits_for_them_before_it_draws(acc, quorum_manager):
    from torch.utils.data import DataLoader

    quorum_manager.participants = [1, 1, 2]
    group = _replica_group(min_replica_groups=2)
    loader = acc.setup_dataloaders(DataLoader(_Logged(quorum_manager.log), batch_size=2))
    group.watch_dataloader(loader)
    assert next(iter(loader)).tolist() == [0, 1]
    assert quorum_manager.log == ["quorum", "quorum", "quorum", "read 0", "read 1"]
    group.begin_step()  # the forward of the same step: no quorum of its own
    assert quorum_manager.log[-1] == "read 1"


def test_too_few_groups_for_quorum_timeout_raises_naming_the_settings(acc, quorum_manager):
    from torch.utils.data import DataLoader

    group = _replica_group(min_replica_groups=2, quorum_timeout=0.2)
    loader = acc.setup_dataloaders(DataLoader(_Logged(quorum_manager.log), batch_size=2))
    group.watch_dataloader(loader)
    with pytest.raises(RuntimeError, match=r"only 1 group\(s\) took part .* min_replica_groups=2"):
        next(iter(loader))
    assert not any(entry.startswith("read") for entry in quorum_manager.log)


def _16_mixed_replica_group():
    """A launched one-process Accelerator: FSDP, "16-mixed", replica group 1 of 2 (on the stand-in manager)."""
    ft = FaultTolerance(replica_group_id=1, num_replica_groups=2)
    with pytest.warns(UserWarning, match="16-mixed"):  # float16 autocast on CPU: slow, but it runs
        acc = Accelerator(
            accelerator="cpu", strategy=FSDPStrategy(fault_tolerance=ft), devices=1, precision="16-mixed"
        )
    acc.launch()
    return acc


def test_the_scaler_and_a_scheduler_given_to_setup_are_healed(quorum_manager):
    import torch

    from minifabric.strategies.ft.heal import module_state

    acc = _16_mixed_replica_group()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    model, optimizer, scheduler = acc.setup(model, optimizer, scheduler=scheduler)
    group = acc.strategy.replica_group
    group._module_views = [module_state(m) for m in group._modules]  # as `begin_step` takes them
    live = group._state()  # what this group would send: change it as a live group's would be
    live["objects"]["minifabric.precision"]["state"]["scaler"]["scale"] = 32768.0
    live["objects"]["minifabric.scheduler0"]["last_epoch"] = 7
    live["objects"]["minifabric.replica_groups"]["id"] = 0
    quorum_manager.heal = live
    loss = model(torch.ones(2, 4)).sum()  # the step's quorum heals
    assert acc.precision.scaler.get_scale() == 32768.0 and scheduler.last_epoch == 7
    acc.backward(loss)
    optimizer.step()
    assert quorum_manager.step == 1


def test_a_scheduler_given_to_setup_that_cannot_be_copied_is_refused(quorum_manager):
    import torch

    class Warmup:  # steps a learning rate, but has no state_dict()
        pass

    acc = _16_mixed_replica_group()
    model = torch.nn.Linear(4, 1)
    with pytest.raises(TypeError, match=r"scheduler=\)` \(Warmup\) has no state_dict"):
        acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=Warmup())


def test_a_dropped_step_after_a_clip_keeps_the_scale_and_the_next_step_clips_again(quorum_manager):
    import torch

    acc = _16_mixed_replica_group()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    quorum_manager.commits = [False]  # the first step fails (a group died during it), then they commit
    weights = [[p.detach().clone() for p in model.parameters()]]
    for _ in range(2):
        acc.backward(model(torch.ones(2, 4)).mean() * 0.01)  # scaled, it stays finite in float16
        acc.clip_gradients(model, optimizer, max_norm=1.0)  # unscales this step's gradients
        optimizer.step()
        optimizer.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
        assert acc.precision.scaler.get_scale() == 65536.0  # the dropped step did not move it
    assert quorum_manager.step == 1
    assert all(
        torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True)
    )  # dropped: nothing changed
    assert not any(
        torch.equal(a, b) for a, b in zip(weights[1], weights[2], strict=True)
    )  # committed: stepped
