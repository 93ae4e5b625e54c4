"""Every sharding strategy, manual wrapping, activation checkpointing, CPU offload and the fp16 grad
scaler train like the single-process reference (2 ranks; HYBRID_SHARD on a (2, 2) mesh of 4)."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifabric import Accelerator, FSDPStrategy, wrap
from tests.helpers import run_distributed
from tests.models import (
    GPT,
    Block,
    GPTConfig,
    gpt_loss,
    gpt_optimizer,
    micro_batches,
    reference_training,
    token_batches,
)

pytestmark = pytest.mark.distributed

STEPS, BATCH = 3, 8
UNTIED = GPTConfig(tied=False)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


class ManualGPT(GPT):
    """The same GPT, with each block sharded by the model code itself through ``minifabric.wrap``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(wrap(block) for block in self.blocks)


def _shard_blocks_with_torch(acc: Accelerator, model: GPT) -> None:
    """The user shards the blocks with torch's ``fully_shard`` directly, before ``setup``."""
    for block in model.blocks:
        fully_shard(block, mesh=acc.strategy.mesh)


def _train(acc: Accelerator, rank: int, build: Any = GPT, prepare: Any = None) -> dict[str, Any]:
    """Build (seed 0, meta init), set up, train STEPS steps; return losses, initial weights, placements."""
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = build(UNTIED)
    if prepare is not None:
        prepare(acc, model)
    optimizer = gpt_optimizer(model)
    model, optimizer = acc.setup(model, optimizer)
    out = {"init": _full(model), "placements": {p.placements for p in model.parameters()}, "losses": []}
    for batch in token_batches(STEPS, BATCH, UNTIED):
        loss = gpt_loss(model, micro_batches(batch, acc.world_size, rank, 1)[0])
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
    return out


def _variants(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "FULL_SHARD": FSDPStrategy(),
        "SHARD_GRAD_OP": FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
        "NO_SHARD": FSDPStrategy(sharding_strategy="NO_SHARD"),
        "cpu_offload": FSDPStrategy(cpu_offload=True),
        "callable_policy": FSDPStrategy(auto_wrap_policy=lambda module, name: isinstance(module, Block)),
        "activation_checkpointing": FSDPStrategy(activation_checkpointing_policy={Block}),
    }
    for name, strategy in cases.items():
        out[name] = _train(Accelerator(accelerator="cpu", strategy=strategy, devices=2), rank)
    out["manual_wrap"] = _train(Accelerator(accelerator="cpu", strategy="fsdp", devices=2), rank, ManualGPT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(auto_wrap_policy={Block}), devices=2)
        out["user_fully_shard"] = _train(acc, rank, prepare=_shard_blocks_with_torch)
    out["warned"] = any("already has sharded submodules" in str(w.message) for w in caught)
    out["inf_clip"] = _inf_norm_clip(rank)
    out["fp16"] = _fp16_scaler(rank)
    return out


def _inf_norm_clip(rank: int) -> tuple[float, float]:
    """norm_type=inf with a parameter of 1 row on 2 ranks (one rank's shard is empty) must not hang."""
    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(), devices=2)
    acc.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Linear(1, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.ones(2, 4) * (rank + 1)).sum())
    full_grads = [p.grad.full_tensor() for p in model.parameters()]
    expected = max(g.abs().max().item() for g in full_grads)
    return acc.clip_gradients(model, optimizer, max_norm=1e9, norm_type=float("inf")).item(), expected


@pytest.fixture(scope="module")
def variants() -> list[dict[str, Any]]:
    return run_distributed(_variants, 2, timeout=240)


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    init = GPT(UNTIED).state_dict()
    losses, _, _ = reference_training(init, UNTIED, token_batches(STEPS, BATCH, UNTIED), 2, 1, max_norm=1e9)
    return losses, init


@pytest.mark.parametrize(
    "case",
    [
        "FULL_SHARD",
        "SHARD_GRAD_OP",
        "NO_SHARD",
        "cpu_offload",
        "callable_policy",
        "activation_checkpointing",
        "manual_wrap",
        "user_fully_shard",
    ],
)
def test_variant_trains_like_single_process(
    variants: list[dict[str, Any]], reference: Any, case: str
) -> None:
    ref_losses, eager_init = reference
    for rank, res in enumerate(variants):
        for key, value in eager_init.items():
            assert torch.equal(res[case]["init"][key], value), (
                f"rank {rank} {case}: {key} differs from eager init"
            )
        torch.testing.assert_close(
            torch.tensor(res[case]["losses"]), torch.tensor([s[rank] for s in ref_losses]), atol=1e-5, rtol=0
        )


def test_manual_wrapping_and_checkpointing_give_the_same_losses_as_plain_fsdp(
    variants: list[dict[str, Any]],
) -> None:
    for res in variants:
        for case in ("manual_wrap", "user_fully_shard", "activation_checkpointing", "callable_policy"):
            assert res[case]["losses"] == res["FULL_SHARD"]["losses"], case


def test_no_shard_replicates_and_policy_with_user_sharding_warns(variants: list[dict[str, Any]]) -> None:
    for res in variants:
        assert res["NO_SHARD"]["placements"] == {(Replicate(), Shard(0))}
        assert res["FULL_SHARD"]["placements"] == {(Shard(0),)}
        assert res["warned"]


def test_inf_norm_clipping_with_an_empty_shard(variants: list[dict[str, Any]]) -> None:
    for res in variants:
        norm, expected = res["inf_clip"]
        assert norm == pytest.approx(expected, rel=1e-6)


def _hybrid(rank: int) -> dict[str, Any]:
    # Two "nodes" of two processes each, on one machine.
    os.environ.update({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2), "NODE_RANK": str(rank // 2)})
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD")
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2, num_nodes=2)
    out = _train(acc, rank)
    return {**out, "mesh": tuple(strategy.mesh.shape), "world": acc.world_size}


def test_hybrid_shard_on_a_2x2_mesh(reference: Any) -> None:
    torch.manual_seed(0)
    init = GPT(UNTIED).state_dict()
    ref_losses, _, _ = reference_training(
        init, UNTIED, token_batches(STEPS, BATCH, UNTIED), 4, 1, max_norm=1e9
    )
    for rank, res in enumerate(run_distributed(_hybrid, 4, timeout=240)):
        assert res["mesh"] == (2, 2) and res["world"] == 4
        assert res["placements"] == {(Replicate(), Shard(0))}
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor([s[rank] for s in ref_losses]), atol=1e-5, rtol=0
        )


def _fp16_scaler(rank: int) -> dict[str, Any]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2, precision="16-mixed")
    acc.launch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, tied=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    batch = micro_batches(token_batches(1, BATCH, UNTIED)[0], 2, rank, 1)[0]
    acc.backward(gpt_loss(model, batch))
    if rank == 0:  # an inf in one rank's gradient shard only
        model.module.blocks[0].fc.weight.grad.to_local()[0, 0] = float("inf")
    before = _full(model)
    scale = acc.precision.scaler.get_scale()
    optimizer.step()
    skipped = all(torch.equal(before[k], v) for k, v in _full(model).items())
    optimizer.zero_grad()
    acc.backward(gpt_loss(model, batch))
    optimizer.step()
    stepped = not all(torch.equal(before[k], v) for k, v in _full(model).items())
    return {"skipped": skipped, "stepped": stepped, "scale": (scale, acc.precision.scaler.get_scale())}


def test_fp16_grad_scaler_skips_the_step_on_every_rank_when_one_rank_has_an_inf(
    variants: list[dict[str, Any]],
) -> None:
    for res in (v["fp16"] for v in variants):
        assert res["skipped"] and res["stepped"]
        assert res["scale"][1] == res["scale"][0] / 2


def _adagrad(rank: int) -> dict[str, Any]:
    """Adagrad builds state in its constructor, before ``setup`` shards the parameters it refers to."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    ref_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1, initial_accumulator_value=0.5)
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    acc.launch()
    model, optimizer = acc.setup(model, optimizer)
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    for batch in batches:  # the same batch on both ranks: the mean gradient is the one-process one
        acc.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
        reference(batch).sum().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"max_diff": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())}


def test_an_optimizer_with_constructor_state_trains_like_one_process_on_every_rank() -> None:
    for result in run_distributed(_adagrad, 2, timeout=120):
        assert result["max_diff"] < 1e-6, result
