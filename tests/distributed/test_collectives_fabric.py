"""Fabric's collective arguments on 3 gloo ranks: ``all_gather(sync_grads=True)``, ``group=``, ``ReduceOp``.

A contrastive loss gathers every rank's embeddings with ``sync_grads=True`` and needs the gradients
of its own slice from every rank's loss (summed, as torch's differentiable all-gather and Fabric do).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def collectives_on_ranks(rank: int, world_size: int) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=world_size)
    acc.launch()
    out: dict = {}
    x = torch.tensor([rank + 1.0, 2.0 * (rank + 1)], requires_grad=True)
    gathered = acc.all_gather({"x": x}, sync_grads=True)["x"]
    weights = torch.arange(1.0, 2 * world_size + 1).reshape(world_size, 2)
    (gathered * weights).sum().backward()
    out["gathered"] = gathered.detach().tolist()
    out["grad"] = x.grad.tolist()  # every rank's loss reaches this rank's slice: world_size * weights[rank]
    out["plain_requires_grad"] = acc.all_gather(x).requires_grad

    group = dist.new_group([0, 1])  # on every rank, as torch requires
    if rank in (0, 1):
        out["group_gather"] = acc.all_gather(torch.tensor([rank]), group=group).tolist()
        out["group_mean"] = acc.all_reduce(torch.tensor(rank + 1.0), group=group).item()
        out["group_sum_op"] = acc.all_reduce(torch.tensor(rank + 1.0), group, dist.ReduceOp.SUM).item()
    else:
        try:
            acc.all_reduce(torch.tensor(1.0), group=group)
            out["outside"] = "no error"
        except ValueError as e:
            out["outside"] = str(e)
    out["world_sum_positional"] = acc.all_reduce(torch.tensor(rank + 1.0), None, "sum").item()
    try:
        acc.all_reduce(torch.tensor(1.0), "sum")
        out["string_group"] = "no error"
    except TypeError as e:
        out["string_group"] = str(e)
    return out


def test_fabric_collective_arguments_on_every_rank() -> None:
    results = run_distributed(collectives_on_ranks, 3, 3, timeout=150)
    weights = torch.arange(1.0, 7.0).reshape(3, 2)
    for rank, out in enumerate(results):
        assert out["gathered"] == [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]]
        assert out["grad"] == (3 * weights[rank]).tolist()
        assert out["plain_requires_grad"] is False
        assert out["world_sum_positional"] == 6.0
        assert 'reduce_op="sum"' in out["string_group"]
        if rank < 2:
            assert out["group_gather"] == [[0], [1]]
            assert out["group_mean"] == 1.5
            assert out["group_sum_op"] == 3.0
        else:
            assert "is not in the group" in out["outside"]


def sync_grads_in_a_group_without_rank_zero(rank: int, world_size: int) -> list[float] | None:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=world_size)
    acc.launch()
    group = dist.new_group([1, 2])  # group ranks 0 and 1 are global ranks 1 and 2
    if rank == 0:
        return None
    x = torch.tensor([float(rank)], requires_grad=True)
    gathered = acc.all_gather(x, group=group, sync_grads=True)
    (gathered * torch.tensor([[1.0], [10.0]])).sum().backward()
    return x.grad.tolist()


def test_sync_grads_over_a_group_that_lacks_rank_zero() -> None:
    results = run_distributed(sync_grads_in_a_group_without_rank_zero, 3, 3, timeout=150)
    assert results == [None, [2.0], [20.0]]  # each of the 2 ranks' losses reaches each slice
