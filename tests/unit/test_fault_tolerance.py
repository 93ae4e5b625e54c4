"""FaultTolerance settings: validation at the public call, the data split across groups, lazy torchft."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

from minifabric import FaultTolerance, FSDPStrategy
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
        "from minifabric.strategies.replica_group import _import_torchft\n"
        "try:\n"
        "    _import_torchft()\n"
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

    def allreduce(self, tensor, reduce_op):
        name = f"ar{sum(entry.startswith('start') for entry in self.log)}"
        self.log.append(f"start {name}")
        manager = self

        class Work:
            def wait(self) -> None:
                manager.log.append(f"wait {name}")

        return Work()


def _group_in_step():
    from minifabric.strategies.replica_group import ReplicaGroup

    group = ReplicaGroup.__new__(ReplicaGroup)  # without torchft: only the all-reduce bookkeeping
    group._in_step, group._pending, group._manager = True, [], _Manager()
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
