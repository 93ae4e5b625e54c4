"""Per-rank seeds before construction (``acc.seed_everything(1337 + rank)``) in the cases the digest
and checksums of setup could miss; every rank must end with rank 0's model, or raise on every rank.

- A meta-built model whose init arguments come from Python's ``random``
  (``normal_(w, std=random.uniform(...))``): the drawn number is recorded as an argument, not as a
  generator state; replaying rank 0's states with this rank's arguments would shard another model.
- An eagerly built block that ``minifabric.wrap`` shards during construction: it is a DTensor by
  ``setup``, too late to compare with rank 0's.
- An eagerly built model under ``ModelParallelStrategy``, whose ``parallelize_fn`` shards it as
  each rank built it.
- A process group the Accelerator adopts (the script's own ``init_process_group``; Ray Train's; an
  earlier Accelerator's in the same process): every rank must still decide alike whether to take
  rank 0's model. Deciding from each rank's own view let rank 0 (comparing with itself) go on
  while another rank waited in a broadcast rank 0 never entered: it hung or paired the wrong
  collectives, and one rank kept its own draws.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minifabric import Accelerator, ModelParallelStrategy, wrap
from tests.helpers import run_distributed
from tests.init_styles import NanoGPTStyle, mismatches

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class RandomStd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        for layer in (self.a, self.b):
            nn.init.normal_(layer.weight, std=random.uniform(0.01, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Wrapped(RandomStd):
    def __init__(self) -> None:
        super().__init__()
        self.a = wrap(self.a)


def shard_over_data_parallel(model: nn.Module, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh["data_parallel"])


def seeded_per_rank(
    rank: int, world_size: int, cls: type, empty_init: bool, strategy: str = "fsdp", adopted: bool = False
) -> str | list[str]:
    if adopted:
        dist.init_process_group("gloo")  # the script's own process group, before the Accelerator
    chosen = ModelParallelStrategy(shard_over_data_parallel) if strategy == "model_parallel" else strategy
    acc = Accelerator(accelerator="cpu", strategy=chosen, devices=world_size)
    acc.launch()
    acc.seed_everything(1337)
    rank_zero_model = cls()
    acc.seed_everything(1337 + rank)
    with acc.init_module(empty_init=empty_init):
        model = cls()
    try:
        model = acc.setup(model)
    except ValueError as e:
        return str(e)
    found = mismatches(rank_zero_model, model)
    # The ranks end together: where gathering the weights needs no collective (a data-parallel mesh
    # of size 1), a rank that ended first, without leaving, was taken for dead and stopped the other.
    acc.barrier()
    return found


def test_python_random_init_arguments_under_per_rank_seeds() -> None:
    results = run_distributed(seeded_per_rank, 2, 2, RandomStd, True, timeout=240)
    errors = [r for r in results if isinstance(r, str)]
    assert results == [[]] * 2 or (len(errors) == 2 and all("argument" in e for e in errors)), results


def test_blocks_wrapped_during_construction_set_up_rank_zeros_model() -> None:
    assert run_distributed(seeded_per_rank, 2, 2, Wrapped, False, timeout=240) == [[]] * 2


def test_model_parallel_sets_up_rank_zeros_model() -> None:
    results = run_distributed(seeded_per_rank, 2, 2, RandomStd, False, "model_parallel", timeout=240)
    assert results == [[]] * 2


@pytest.mark.parametrize(("strategy", "empty_init"), [("fsdp", False), ("fsdp", True), ("model_parallel", False)])
def test_per_rank_seeds_in_an_adopted_process_group_set_up_rank_zeros_model(strategy: str, empty_init: bool) -> None:
    results = run_distributed(seeded_per_rank, 2, 2, NanoGPTStyle, empty_init, strategy, True, timeout=120)
    assert results == [[]] * 2


def other_model_on_rank_one(rank: int) -> str:
    dist.init_process_group("gloo")
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    acc.launch()
    model = NanoGPTStyle()
    if rank == 1:
        model.extra = nn.Linear(2, 2)
    try:
        acc.setup(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_built_other_tensors_raise_on_every_rank_naming_the_rank() -> None:
    results = run_distributed(other_model_on_rank_one, 2, timeout=120)
    assert all("on rank 1 than on rank 0" in r for r in results), results
