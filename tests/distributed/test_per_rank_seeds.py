"""A model built after per-rank seeding (nanoGPT's ``torch.manual_seed(1337 + rank)``) sets up as rank 0's.

Under DDP rank 0's weights are broadcast; under FSDP each rank keeps its slice of what it built (or
replays its own recorded draws), so without agreement the sharded model mixes seeds. Every rank
gathers the full weights of the set-up model and compares them with rank 0's eager construction.
"""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator, FSDPStrategy
from tests.helpers import run_distributed
from tests.init_styles import NanoGPTStyle, mismatches

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def seeded_per_rank(rank: int, world_size: int, strategy: str, empty_init: bool) -> list[str]:
    chosen = FSDPStrategy(sync_module_states=True) if strategy == "fsdp-sync" else strategy
    acc = Accelerator(accelerator="cpu", strategy=chosen, devices=world_size)
    acc.launch()
    torch.manual_seed(1337)
    rank_zero_model = NanoGPTStyle()
    torch.manual_seed(1337 + rank)  # as nanoGPT's train.py, before building the model
    with acc.init_module(empty_init=empty_init):
        model = NanoGPTStyle()
    model = acc.setup(model)
    state = torch.get_rng_state()
    torch.manual_seed(1337 + rank)
    NanoGPTStyle()
    if not torch.equal(state, torch.get_rng_state()):  # setup leaves each rank's own stream alone
        return ["rng"]
    return mismatches(rank_zero_model, model)


@pytest.mark.parametrize(
    ("world_size", "strategy", "empty_init"),
    [(2, "fsdp", True), (2, "fsdp", False), (2, "fsdp-sync", True), (2, "ddp", True), (4, "fsdp", True)],
)
def test_per_rank_seeds_set_up_rank_zeros_model(world_size: int, strategy: str, empty_init: bool) -> None:
    results = run_distributed(seeded_per_rank, world_size, world_size, strategy, empty_init, timeout=240)
    assert results == [[]] * world_size


def other_init_on_rank_one(rank: int, world_size: int) -> str:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    torch.manual_seed(1337 + rank)
    with acc.init_module(empty_init=True):
        model = NanoGPTStyle()
        if rank == 1:  # one more random call than rank 0: not the same model code
            torch.nn.init.normal_(model.ln_f.weight)
    try:
        acc.setup(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_recorded_other_init_calls_raise_on_every_rank() -> None:
    results = run_distributed(other_init_on_rank_one, 2, 2, timeout=240)
    assert all("rank 1:" in r and "every rank must run the same model code" in r for r in results), results
