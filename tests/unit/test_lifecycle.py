"""Process-level defaults of a run: CPU threads per rank, the collective timeout, seeding."""

import os
import random
from datetime import timedelta

import pytest
import torch

from minifabric.runtime.environment import available_cores, share_cpu_cores
from minifabric.runtime.rank import collective_timeout
from minifabric.seed import seed_everything


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_more_processes_than_cores_warns_and_each_rank_gets_one_thread(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = available_cores()
    with pytest.warns(
        UserWarning, match=rf"{cores + 1} processes on this machine but only {cores} CPU cores"
    ):
        share_cpu_cores(cores + 1, warn=True)
    assert torch.get_num_threads() == 1


def test_each_rank_gets_its_share_of_the_cores_unless_omp_num_threads_is_set(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share_cpu_cores(1, warn=True)
    assert torch.get_num_threads() == available_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    share_cpu_cores(1, warn=False)
    assert torch.get_num_threads() == 1


def test_the_collective_timeout_comes_from_the_environment_unless_given(monkeypatch):
    default = timedelta(minutes=30)
    monkeypatch.setenv("MINIFABRIC_TIMEOUT", "7.5")
    assert collective_timeout(default, explicit=False) == timedelta(seconds=7.5)
    assert collective_timeout(timedelta(seconds=60), explicit=True) == timedelta(seconds=60)
    monkeypatch.setenv("MINIFABRIC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MINIFABRIC_TIMEOUT='soon' is not a number of seconds"):
        collective_timeout(default, explicit=False)


def test_seed_everything_seeds_python_and_torch_and_checks_the_range():
    seed_everything(123)
    first = (random.random(), torch.rand(1).item())
    seed_everything(123)
    assert (random.random(), torch.rand(1).item()) == first
    assert os.environ["PL_GLOBAL_SEED"] == "123"
    with pytest.raises(ValueError, match="seed=-1 is out of range"):
        seed_everything(-1)
