"""Which environment started this process, and the checks that refuse a broken one before any wait."""

from datetime import timedelta

import pytest
from lightning_fabric.plugins.environments import KubeflowEnvironment

from minifabric import Accelerator
from minifabric.runtime.environment import LocalEnvironment, detect_cluster_environment, world_of
from minifabric.runtime.launcher import JoinLauncher
from minifabric.runtime.rendezvous import (
    JOIN_TIMEOUT_VAR,
    LOCAL_JOIN_SECONDS,
    World,
    check_world,
    join_timeout,
)


def _setenv(monkeypatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_one_process_per_pod_is_kubeflow_and_only_joined(monkeypatch):
    _setenv(monkeypatch, MASTER_ADDR="trainer-master-0", MASTER_PORT="23456", WORLD_SIZE="4", RANK="2")
    env = detect_cluster_environment()
    assert type(env) is KubeflowEnvironment
    acc = Accelerator(accelerator="cpu")
    assert (acc.global_rank, acc.local_rank, acc.world_size) == (2, 0, 4)
    assert acc.strategy.num_processes == 1  # one process in this pod
    assert type(acc.strategy).__name__ == "DDPStrategy"  # "auto" over a world of 4, not "single"
    assert type(acc.strategy.launcher) is JoinLauncher
    world = world_of(env)
    assert (world.rank, world.world_size, world.address, world.port) == (2, 4, "trainer-master-0", 23456)
    assert (world.rank_var, world.world_size_var, world.address_var) == ("RANK", "WORLD_SIZE", "MASTER_ADDR")
    assert not world.counted  # each pod was given its variables: nothing counted the processes


def test_a_local_rank_means_a_local_launcher_started_it(monkeypatch):
    _setenv(
        monkeypatch, MASTER_ADDR="127.0.0.1", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1", LOCAL_RANK="1"
    )
    assert type(detect_cluster_environment()) is LocalEnvironment


def test_pet_variables_outside_torchrun_raise(monkeypatch):
    _setenv(monkeypatch, PET_NPROC_PER_NODE="4", PET_NNODES="2")
    with pytest.raises(ValueError, match=r"PET_NPROC_PER_NODE=4 .*`torchrun train.py`"):
        Accelerator(accelerator="cpu")


def test_a_slurm_job_without_a_node_list_raises(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS="2", SLURM_JOB_NAME="train", SLURM_JOB_ID="77", SLURM_PROCID="0",
            SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NODELIST="n[1-2]")  # fmt: skip
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(
        ValueError, match=r"SLURM_NODELIST is not set.*export SLURM_NODELIST=\$SLURM_JOB_NODELIST"
    ):
        Accelerator(accelerator="cpu")


def test_slurm_errors_name_slurm_variables(monkeypatch):
    _setenv(monkeypatch, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NAME="train",
            SLURM_JOB_ID="1234", SLURM_NODELIST="node1", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="0")  # fmt: skip
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    world = world_of(detect_cluster_environment())
    with pytest.raises(ValueError, match=r"SLURM_PROCID=3 is outside the world of SLURM_NTASKS=2"):
        check_world(world)


@pytest.mark.parametrize(
    ("rank", "size", "message"),
    [(2, 2, r"RANK=2 is outside the world of WORLD_SIZE=2"), (-1, 2, r"RANK=-1 is outside"),
     (0, 0, r"WORLD_SIZE=0 is not a number of processes")],
)  # fmt: skip
def test_a_rank_outside_the_world_raises_naming_it(rank, size, message):
    with pytest.raises(ValueError, match=message):
        check_world(World(rank=rank, world_size=size, address="127.0.0.1", port=29500))


def test_join_timeout_is_short_only_for_hand_set_ranks_on_this_machine(monkeypatch):
    monkeypatch.delenv(JOIN_TIMEOUT_VAR, raising=False)
    here = World(rank=0, world_size=2, address="127.0.0.1", port=29500, counted=False)
    there = World(rank=0, world_size=2, address="10.1.2.3", port=29500, counted=False)
    launched = World(rank=0, world_size=2, address="127.0.0.1", port=29500)  # torchrun, srun, launch()
    assert join_timeout(here, timedelta(minutes=30)) == LOCAL_JOIN_SECONDS
    assert join_timeout(there, timedelta(minutes=30)) == 1800
    assert join_timeout(launched, timedelta(minutes=30)) == 1800
    monkeypatch.setenv(JOIN_TIMEOUT_VAR, "120")
    assert join_timeout(here, timedelta(minutes=30)) == 120
    monkeypatch.setenv(JOIN_TIMEOUT_VAR, "soon")
    with pytest.raises(ValueError, match=r"MINIFABRIC_JOIN_TIMEOUT='soon' must be a positive number"):
        join_timeout(here, timedelta(minutes=30))
