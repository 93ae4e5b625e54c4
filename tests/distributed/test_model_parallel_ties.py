"""Tied weights under ``ModelParallelStrategy`` on 4 CPU ranks (dp, tp) = (2, 2), against one process.

``parallelize_module`` replaces the parameters of each planned layer, so an embedding tied to the
output layer silently became two weights that trained apart. ``setup`` now refuses that on every
rank, naming both parameters and the fix; a function that ties them again after its plan trains
as one process (also built in ``init_module(empty_init=True)``), and the weight stays shared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric import Accelerator, ModelParallelStrategy
from tests.helpers import run_distributed
from tests.tp_models import TPConfig, TPTransformer, parallelize, tp_batches, tp_loss, tp_optimizer

pytestmark = pytest.mark.distributed

CFG = TPConfig()


def _tied() -> TPTransformer:
    model = TPTransformer(CFG)
    model.out.weight = model.tok_emb.weight
    return model


def _retie(model: nn.Module, mesh: Any) -> nn.Module:
    parallelize(model, mesh)
    model.out.weight = model.tok_emb.weight  # both plans shard the weight along the vocabulary
    return model


def _ranks(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    acc = Accelerator(accelerator="cpu", strategy=ModelParallelStrategy(parallelize, 2, 2), devices=4)
    acc.launch()
    try:
        acc.setup(_tied())
        out["untied"] = "no error"
    except ValueError as error:
        out["untied"] = str(error)
    acc = Accelerator(accelerator="cpu", strategy=ModelParallelStrategy(_retie, 2, 2), devices=4)
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = _tied()
    model, optimizer = acc.setup(model, tp_optimizer(model))
    group = acc.strategy.device_mesh["data_parallel"].get_local_rank()
    for batch in tp_batches(2, 8, CFG):
        acc.backward(tp_loss(model, batch.chunk(2)[group]))
        optimizer.step()
        optimizer.zero_grad()
    out["still_tied"] = model.module.out.weight is model.module.tok_emb.weight
    out["final"] = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return out


def test_tied_weights_are_kept_or_refused() -> None:
    results = run_distributed(_ranks, 4, timeout=300)
    torch.manual_seed(0)
    model = _tied()
    optimizer = tp_optimizer(model)
    for batch in tp_batches(2, 8, CFG):
        torch.stack([tp_loss(model, half) for half in batch.chunk(2)]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    ref = model.state_dict()
    for out in results:
        assert "untied 'out.weight' from 'tok_emb.weight'" in out["untied"], out["untied"]
        assert "model.out.weight = model.tok_emb.weight" in out["untied"]
        assert out["still_tied"]
        got = out["final"]
        assert got.keys() == ref.keys()
        # 5e-6: the tied gradient is summed over the embedding and the output layer in another order
        assert all(torch.allclose(got[k], ref[k], rtol=0, atol=5e-6) for k in ref)
