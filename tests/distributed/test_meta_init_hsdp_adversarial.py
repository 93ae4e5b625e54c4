"""Meta init under FSDP and HSDP against eager construction, on every rank, where a kept part could be
taken for a shard it is not: user meshes whose ranks are not in row-major order, uneven rows, tied
weights, and a part sharded inside the block (``wrap``) then initialized there."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from minifabric import Accelerator, FSDPStrategy, wrap
from tests.helpers import run_distributed
from tests.init_styles import mismatches

pytestmark = pytest.mark.distributed


class Uneven(nn.Module):
    """Rows not divisible by the shards (5 over 2 or 4; 3 over 4 leaves a rank empty), tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 3)
        self.c = nn.Embedding(7, 5)
        self.d = nn.Linear(5, 7, bias=False)
        self.d.weight = self.c.weight
        self.e = nn.Parameter(torch.empty(1, 4))
        nn.init.normal_(self.e)


class WrappedThenZeroed(nn.Module):
    """Shards a part inside the block (``wrap``), then writes it without drawing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = wrap(nn.Linear(4, 6))
        self.b = nn.Linear(6, 5)
        nn.init.zeros_(self.a.bias)
        nn.init.constant_(self.a.weight, 0.5)


class WrappedThenDrawn(nn.Module):
    """Shards a part inside the block (``wrap``), then draws its weight: eager construction draws each
    rank's part of the DTensor by DTensor's random rules (here, each rank from its own generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = wrap(nn.Linear(4, 6))
        self.b = nn.Linear(6, 5)
        nn.init.normal_(self.a.weight)


def _mesh(kind: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    names = ("replicate", "shard")
    if kind == "permuted":  # rank r at (r % 2, r // 2): shard index r // 2, not r % 2
        return DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=names)
    if kind == "reversed":
        return DeviceMesh("cpu", torch.tensor([[3, 2, 1, 0]]), mesh_dim_names=names)
    return None if kind == "default" else tuple(int(x) for x in kind.split("x"))


def _build(rank: int, kind: str, build: str, sharding: str) -> dict[str, Any]:
    """Eager and meta construction of ``build`` under ``sharding``; the differences and what was kept."""
    import importlib

    import torch.distributed as dist

    driver = importlib.import_module("minifabric.init.materialize")  # the package's `materialize` is the function
    user_mesh = kind in ("permuted", "reversed")
    nodes = 1 if user_mesh else 2
    os.environ.update({"LOCAL_WORLD_SIZE": str(4 // nodes), "LOCAL_RANK": str(rank % (4 // nodes))})
    os.environ["NODE_RANK"] = str(rank // (4 // nodes))
    if user_mesh:
        dist.init_process_group("gloo")
    strategy = FSDPStrategy(sharding_strategy=sharding, device_mesh=_mesh(kind))
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=4 // nodes, num_nodes=nodes)
    acc.launch()
    cls = {"uneven": Uneven, "zeroed": WrappedThenZeroed, "drawn": WrappedThenDrawn}[build]
    torch.manual_seed(0)
    with acc.init_module(empty_init=False):
        eager = acc.setup(cls())
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = cls()
    kept: list[int] = []
    shards = driver.kept_shards
    driver.kept_shards = lambda places: kept.append(len(found := shards(places))) or found
    try:
        model = acc.setup(model)
    except ValueError as e:
        return {"refused": str(e)}
    return {"mismatches": mismatches(eager, model), "kept": kept}


@pytest.mark.parametrize("kind", ["default", "1x4", "4x1", "permuted", "reversed"])
def test_hsdp_meta_init_of_uneven_and_tied_weights_equals_eager_on_every_rank(kind: str) -> None:
    for rank, res in enumerate(run_distributed(_build, 4, kind, "uneven", "HYBRID_SHARD", timeout=300)):
        assert res["mismatches"] == [], (rank, res)
        assert res["kept"] and res["kept"][0] > 0, (rank, res)  # the check let kept parts through


def test_hsdp_meta_init_of_a_part_wrapped_then_written_in_the_block_equals_eager_on_every_rank() -> None:
    for rank, res in enumerate(run_distributed(_build, 4, "default", "zeroed", "HYBRID_SHARD", timeout=300)):
        assert res["mismatches"] == [], (rank, res)


@pytest.mark.parametrize("sharding", ["HYBRID_SHARD", "FULL_SHARD"])
def test_a_random_init_of_a_part_wrap_sharded_in_the_block_is_refused_on_every_rank(sharding: str) -> None:
    """Before, ``setup`` gave the rows of one draw of the whole weight: not eager construction's values."""
    for rank, res in enumerate(run_distributed(_build, 4, "default", "drawn", sharding, timeout=300)):
        assert "a.weight" in res.get("refused", ""), (rank, res)
        assert "`normal_` draws random numbers into it after `wrap` sharded it" in res["refused"], (rank, res)
        assert "before `wrap(...)`" in res["refused"], (rank, res)
