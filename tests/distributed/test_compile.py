"""torch.compile on 2 ranks: FSDP (per-block inductor compile) trains like eager, DDP too, and
checkpoints move between compiled and eager models in both directions."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from minifabric import Accelerator, DDPStrategy, FSDPStrategy
from tests.distributed.test_fsdp_equivalence import full_state
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss, micro_batches, token_batches

pytestmark = pytest.mark.distributed

STEPS, BATCH = 10, 4
CFG = GPTConfig(tied=False)


def _pair(acc: Accelerator, compiled: nn.Module, steps: int, rank: int) -> tuple[Any, Any, list, list]:
    """Set up an eager and a compiled GPT with the same init; train both on the same batches."""
    models, losses = [], []
    for make in (lambda m: m, lambda m: compiled(m)):
        torch.manual_seed(0)
        model = make(GPT(CFG))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        models.append(acc.setup(model, optimizer))
        losses.append([])
    for batch in token_batches(steps, BATCH, CFG):
        for (model, optimizer), out in zip(models, losses, strict=True):
            loss = gpt_loss(model, micro_batches(batch, 2, rank, 1)[0])
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
    return models[0][0], models[1][0], losses[0], losses[1]


def _run(rank: int, tmp: str) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # no cache shared between runs
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("minifabric.strategies.fsdp").addHandler(handler)
    logging.getLogger("minifabric.strategies.fsdp").setLevel(logging.INFO)

    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(), devices=2)
    acc.launch()
    eager, compiled, eager_losses, compiled_losses = _pair(acc, torch.compile, STEPS, rank)
    out: dict[str, Any] = {"fsdp": (eager_losses, compiled_losses), "log": records}
    out["keys"] = [k for k in compiled.state_dict() if "_orig_mod" in k]
    out["blocks_compiled"] = [b._compiled_call_impl is not None for b in compiled.module.blocks]

    # a checkpoint saved with compile loads without it, and back
    compiled_state, eager_state = full_state(compiled), full_state(eager)
    acc.save(Path(tmp, "compiled"), {"model": compiled})
    acc.save(Path(tmp, "eager"), {"model": eager})
    acc.load(Path(tmp, "compiled"), {"model": eager})
    acc.load(Path(tmp, "eager"), {"model": compiled})
    out["eager_loaded"] = all(torch.equal(v, compiled_state[k]) for k, v in full_state(eager).items())
    out["compiled_loaded"] = all(torch.equal(v, eager_state[k]) for k, v in full_state(compiled).items())
    batch = token_batches(1, BATCH, CFG)[0]
    # (with grad enabled, as in training: no_grad would compile the blocks once more)
    out["forward_gap"] = (compiled(batch[:, :-1]) - eager(batch[:, :-1])).abs().max().item()

    ddp = Accelerator(accelerator="cpu", strategy=DDPStrategy(), devices=2)
    _, ddp_compiled, ddp_eager_losses, ddp_losses = _pair(
        ddp, lambda m: torch.compile(m, backend="aot_eager"), 3, rank
    )
    out["ddp"] = (ddp_eager_losses, ddp_losses)
    out["ddp_keys"] = [k for k in ddp_compiled.state_dict() if "_orig_mod" in k]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_run, 2, str(tmp_path_factory.mktemp("compile")), timeout=300)


@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp_compiled_per_block_trains_like_eager(results: list[dict[str, Any]], rank: int) -> None:
    eager, compiled = results[rank]["fsdp"]
    assert len(compiled) == STEPS
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) <= 1e-5
    assert results[rank]["blocks_compiled"] == [True, True]
    assert any("torch.compile(model) was unwrapped" in line for line in results[rank]["log"])
    assert results[rank]["keys"] == []


@pytest.mark.parametrize("rank", [0, 1])
def test_checkpoints_move_between_compiled_and_eager(results: list[dict[str, Any]], rank: int) -> None:
    assert results[rank]["eager_loaded"]
    assert results[rank]["compiled_loaded"]
    assert results[rank]["forward_gap"] <= 1e-5


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_compiled_trains_like_eager(results: list[dict[str, Any]], rank: int) -> None:
    eager, compiled = results[rank]["ddp"]
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) <= 1e-5
    assert results[rank]["ddp_keys"] == []
