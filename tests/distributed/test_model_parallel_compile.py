"""``torch.compile`` inside a ``parallelize_fn``, on 2 CPU ranks (dp, tp) = (1, 2), against one process.

A function may return ``torch.compile(model)`` or put ``torch.compile(block)`` into the model (both
add ``_orig_mod.`` to parameter names): the strategy sets up the original modules compiled in place,
so training equals one process and the names are the model's. Compiling the whole model around
FSDP units the function made itself fails inside torch.compile; it is refused at ``setup`` with the
fix. One spawned job runs every case (a cheap backend keeps it fast).
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
BACKEND = "aot_eager"


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _returns_compiled(model: nn.Module, mesh: Any) -> nn.Module:
    parallelize(model, mesh)
    return torch.compile(model, backend=BACKEND)


def _compiled_blocks(model: nn.Module, mesh: Any) -> nn.Module:
    parallelize(model, mesh)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=BACKEND)
    return model


def _sharded_then_compiled(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    parallelize(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return torch.compile(model, backend=BACKEND)


def _train(fn: Any) -> dict[str, torch.Tensor]:
    strategy = ModelParallelStrategy(fn, data_parallel_size=1, tensor_parallel_size=2)
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2)
    acc.launch()
    torch.manual_seed(0)
    model = TPTransformer(CFG)
    model, optimizer = acc.setup(model, tp_optimizer(model))
    for batch in tp_batches(2, 4, CFG):
        acc.backward(tp_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return _full(model)


def _ranks(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "returns_compiled": _train(_returns_compiled),
        "compiled_blocks": _train(_compiled_blocks),
    }
    try:
        _train(_sharded_then_compiled)
        out["refused"] = "no error"
    except TypeError as error:
        out["refused"] = str(error)
    return out


def test_compile_inside_parallelize_fn() -> None:
    results = run_distributed(_ranks, 2, timeout=300)
    torch.manual_seed(0)
    model = TPTransformer(CFG)
    optimizer = tp_optimizer(model)
    for batch in tp_batches(2, 4, CFG):
        tp_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    ref = model.state_dict()
    for out in results:
        for case in ("returns_compiled", "compiled_blocks"):
            got = out[case]
            assert got.keys() == ref.keys(), (case, sorted(set(got) ^ set(ref))[:3])  # no `_orig_mod.`
            assert all(torch.allclose(got[k], ref[k], rtol=0, atol=1e-6) for k in ref), case
        assert "already applied `fully_shard`" in out["refused"] and "block.compile()" in out["refused"]
