"""Meta init under HSDP (``HYBRID_SHARD``): each rank keeps its shard's rows of the first random write
of each parameter at construction, so ``setup`` draws nothing again, and the model equals eager
construction on every rank."""

from __future__ import annotations

import os
from typing import Any

import pytest
from torch.distributed.tensor import Replicate, Shard

from minifabric import Accelerator, FSDPStrategy
from tests.helpers import run_distributed
from tests.init_styles import mismatches

pytestmark = pytest.mark.distributed


def _build() -> Any:
    from tests.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=10, tied=False))


def _hsdp(rank: int, shape: tuple[int, int] | None) -> dict[str, Any]:
    import importlib

    import torch

    driver = importlib.import_module("minifabric.init.materialize")  # the package's `materialize` is the function

    os.environ.update({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2), "NODE_RANK": str(rank // 2)})
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=shape)
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2, num_nodes=2)
    acc.launch()
    torch.manual_seed(0)
    eager = _build()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = _build()
    replayed = []
    value_of = driver.value_of
    driver.value_of = lambda handle: replayed.append(any(op.draws for op in handle.base.ops)) or value_of(handle)
    model = acc.setup(model)
    return {
        "mismatches": mismatches(eager, model),
        "replayed": replayed.count(True),  # random draws run again (ones/zeros are replayed: cheap)
        "placements": {tuple(p.placements) for p in model.parameters()},
        "mesh": tuple(strategy.mesh.shape),
    }


@pytest.mark.parametrize("shape", [None, (1, 4)], ids=["2-nodes-x-2", "1x4"])
def test_hsdp_meta_init_equals_eager_construction_and_replays_nothing(shape: tuple[int, int] | None) -> None:
    for rank, res in enumerate(run_distributed(_hsdp, 4, shape, timeout=240)):
        assert res["mesh"] == (shape or (2, 2))
        assert res["placements"] == {(Replicate(), Shard(0))}
        assert res["mismatches"] == [], rank
        assert res["replayed"] == 0, rank  # every random first write kept this rank's rows
