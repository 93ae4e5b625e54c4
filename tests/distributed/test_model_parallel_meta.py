"""Meta-device init under ``ModelParallelStrategy`` on 2 CPU ranks, mesh (dp, tp) = (1, 2), against eager.

One 2-rank job, every rank checks its own set-up model against the eager reference it builds itself
(same seed) and returns what differed:

- a ``parallelize_fn`` that swaps ``nn.Linear`` for a subclass built ``from_float``-style (torchao's
  ``convert_to_float8_training``: a new module built on the meta device takes over the old module's
  ``Parameter`` objects), before or after the tensor-parallel plan, also with ``fully_shard`` in the
  function: the modules now in the model get eager construction's weights. A swap that builds new
  meta parameters instead of taking over the old ones is refused, naming the module;
- a model built under plain ``torch.device("meta")`` is set up as under ``"fsdp"`` (Lightning
  Fabric's way: ``reset_parameters()`` after materialization), also with the swap;
- ``verify=True`` runs under this strategy: it finds an init the recording cannot see, and keeps
  quiet about a pretrained part loaded with ``assign=True`` (a real buffer included), which is kept;
- a zero-element parameter that is never written (DINOv3's default register tokens) is set up.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric import Accelerator, ModelParallelStrategy
from tests.helpers import run_distributed
from tests.meta_cases import Registers, SwappedLinear, fine_tune_with_verify
from tests.tp_models import TPConfig, TPTransformer, parallelize

pytestmark = pytest.mark.distributed

CFG = TPConfig()


class FreshLinear(nn.Linear):
    """A swap that builds new meta parameters instead of taking over the old ones: no known value."""

    @classmethod
    def from_float(cls, mod: nn.Linear) -> FreshLinear:
        with torch.device("meta"):
            return cls(mod.in_features, mod.out_features, bias=mod.bias is not None)


def _swap(model: nn.Module, cls: Any = SwappedLinear) -> None:
    """Replace every ``nn.Linear`` inside the blocks, as ``convert_to_float8_training`` does."""
    for parent in list(model.blocks.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, cls.from_float(child))


def swap_then_plan(model: nn.Module, mesh: Any) -> nn.Module:
    _swap(model)
    return parallelize(model, mesh)


def plan_then_swap(model: nn.Module, mesh: Any) -> nn.Module:
    parallelize(model, mesh)
    _swap(model)
    return model


def swap_plan_and_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """Lightning's fp8 example: convert, apply the plan, ``fully_shard`` each block in the function."""
    from torch.distributed.fsdp import fully_shard

    _swap(model)
    parallelize(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return model


def fresh_swap(model: nn.Module, mesh: Any) -> nn.Module:
    _swap(model, FreshLinear)
    return parallelize(model, mesh)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _differ(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], skip: tuple = ()) -> list[str]:
    if expected.keys() != got.keys():
        return [f"keys {sorted(expected.keys() ^ got.keys())}"]
    return [k for k in expected if k not in skip and not torch.equal(expected[k], got[k])]


def _acc(fn: Any) -> Accelerator:
    acc = Accelerator(accelerator="cpu", strategy=ModelParallelStrategy(fn, 1, 2), devices=2)
    acc.launch()
    return acc


def _swapped(acc: Accelerator, eager: dict[str, torch.Tensor]) -> list[str]:
    """The model built in ``init_module(empty_init=True)``, set up through ``acc``'s swapping function."""
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = TPTransformer(CFG)
    model = acc.setup(model)
    problems = _differ(eager, _full(model))
    if not isinstance(model.module.blocks[0].mlp.w1, SwappedLinear):
        problems.append("not swapped")
    return problems


def _fabric_reference() -> dict[str, torch.Tensor]:
    """A plain-meta ``TPTransformer`` materialized by Lightning Fabric itself, after seed 0."""
    from lightning_fabric.utilities.init import _materialize_distributed_module

    with torch.device("meta"):
        reference = TPTransformer(CFG)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric's warning about `scale` (no reset_parameters)
        _materialize_distributed_module(reference, torch.device("cpu"))
    return _full(reference)


def _plain_meta(fn: Any, reference: dict[str, torch.Tensor]) -> list[str]:
    acc = _acc(fn)
    with torch.device("meta"):
        model = TPTransformer(CFG)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = acc.setup(model)
    problems = _differ(reference, _full(model), skip=("scale",))  # uninitialized memory on both sides
    if not any("Parameter initialization incomplete" in str(w.message) for w in caught):
        problems.append("no warning naming the module without reset_parameters")
    return problems


class _Unseen(nn.Module):
    """An init the recording cannot see: a helper that skips meta tensors, as some libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if not self.b.weight.is_meta:
            nn.init.constant_(self.b.weight, 0.5)


def _plan_up(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if hasattr(model, "backbone"):
        parallelize_module(model, mesh["tensor_parallel"], {"backbone.up": ColwiseParallel()})
    return model


def _verify() -> dict[str, Any]:
    acc = _acc(_plan_up)
    out: dict[str, Any] = {}
    with acc.init_module(empty_init=True, verify=True):
        unseen = _Unseen()
    try:
        acc.setup(unseen)
        out["unseen"] = "no error"
    except RuntimeError as error:
        out["unseen"] = str(error)
    try:
        pretrained, eager, model = fine_tune_with_verify(acc)
    except RuntimeError as error:
        out["assign"] = [str(error)]
        return out
    got = _full(model)
    out["assign"] = _differ(_full(eager.head), {k[5:]: v for k, v in got.items() if k.startswith("head.")})
    out["assign"] += _differ(
        _full(pretrained), {k[9:]: v for k, v in got.items() if k.startswith("backbone.")}
    )
    return out


def _zero_elements() -> list[str]:
    acc = _acc(lambda model, mesh: model)
    torch.manual_seed(3)
    eager = Registers()
    torch.manual_seed(3)
    with acc.init_module(empty_init=True):
        model = Registers()
    try:
        model = acc.setup(model)
    except ValueError as error:
        return [str(error)]
    tokens = model.module.storage_tokens
    # torch's `full_tensor()` of a zero-element FSDP parameter on a 1-rank mesh gives (0, 0, 8): its shape is compared
    problems = [] if tokens.shape == eager.storage_tokens.shape else [f"storage_tokens {tuple(tokens.shape)}"]
    return problems + _differ(_full(eager.proj), _full(model.module.proj))


def _ranks(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    eager = _full(TPTransformer(CFG))
    out: dict[str, Any] = {
        fn.__name__: _swapped(_acc(fn), eager) for fn in (swap_then_plan, plan_then_swap, swap_plan_and_shard)
    }
    try:
        _swapped(_acc(fresh_swap), eager)
        out["fresh"] = "no error"
    except ValueError as error:
        out["fresh"] = str(error)
    reference = _fabric_reference()
    out["plain_meta"] = _plain_meta(parallelize, reference)
    out["plain_meta_swap"] = _plain_meta(swap_plan_and_shard, reference)
    out.update(_verify())
    out["zero_elements"] = _zero_elements()
    return out


def test_meta_init_under_model_parallel_equals_eager_on_every_rank() -> None:
    pytest.importorskip("lightning_fabric")
    results = run_distributed(_ranks, 2, timeout=300)
    for out in results:
        for name in ("swap_then_plan", "plan_then_swap", "swap_plan_and_shard"):
            assert out[name] == [], (name, out[name])
        assert "parameter 'blocks.0.attn.wq.weight'" in out["fresh"], out["fresh"]
        assert "(in FreshLinear)" in out["fresh"] and "fresh_swap" in out["fresh"], out["fresh"]
        assert out["plain_meta"] == [] and out["plain_meta_swap"] == [], out
        assert "_Unseen.b.weight differs from eager" in out["unseen"], out["unseen"]
        assert out["assign"] == [], out["assign"]
        assert out["zero_elements"] == [], out["zero_elements"]
