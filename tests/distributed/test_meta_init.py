"""Meta-device init on 2 and 4 ranks equals eager construction with the same seed, bitwise.

Every rank builds the eager reference itself (same seed) and compares the gathered full weights and
buffers of the model it set up from ``init_module(empty_init=True)``; each rank returns what differed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.init_styles import STYLES, full_state, mismatches
from tests.models import NoInit

pytestmark = pytest.mark.distributed


def styles_on_ranks(rank: int, world_size: int, strategy: str) -> dict[str, list[str]]:
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=world_size)
    acc.launch()
    failures = {}
    for name, cls in STYLES.items():  # each model built in init_module after the previous was set up
        torch.manual_seed(3)
        eager = cls()
        torch.manual_seed(3)
        with acc.init_module(empty_init=True):
            model = cls()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = acc.setup(model, optimizer)
        failures[name] = mismatches(eager, model)
        before = full_state(model)
        acc.backward(model(torch.tensor([[1, 2, 3, 4]])).float().pow(2).mean())
        optimizer.step()
        if all(torch.equal(before[k], v) for k, v in full_state(model).items()):
            failures[name].append("did not train")
    return failures


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "fsdp"), (2, "ddp"), (4, "fsdp")])
def test_init_styles_equal_eager_construction_on_every_rank(world_size: int, strategy: str) -> None:
    results = run_distributed(styles_on_ranks, world_size, world_size, strategy, timeout=240)
    assert results == [{name: [] for name in STYLES}] * world_size


def _hf_model(arch: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def hf_on_ranks(rank: int, world_size: int, arch: str) -> dict[str, Any]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    torch.manual_seed(0)
    reference = _hf_model(arch)
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = _hf_model(arch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.setup(model, optimizer)
    inner = model.module
    out: dict[str, Any] = {
        "init": mismatches(reference, model),
        "tied": inner.lm_head.weight is inner.get_input_embeddings().weight,
    }
    initial = full_state(reference)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    batches = torch.randint(0, 64, (3, 4, 9), generator=torch.Generator().manual_seed(1))
    for batch in batches:
        chunks = batch.chunk(world_size)
        acc.backward(model(input_ids=chunks[rank], labels=chunks[rank]).loss)
        optimizer.step()
        optimizer.zero_grad()
        losses = [reference(input_ids=c, labels=c).loss for c in chunks]  # what gradient averaging computes
        torch.stack(losses).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    expected, actual = full_state(reference), full_state(model)
    out["max_diff_after_training"] = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    out["moved"] = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transformers_model_equals_eager_and_trains_like_one_process(arch: str) -> None:
    pytest.importorskip("transformers")
    for result in run_distributed(hf_on_ranks, 2, 2, arch, timeout=240):
        assert result["init"] == []
        assert result["tied"]
        assert result["max_diff_after_training"] < 1e-5
        assert result["moved"] > 1e-3  # the comparison is not vacuous: training changed the weights


def never_initialized_on_ranks(rank: int, world_size: int) -> str:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = NoInit()
    try:
        acc.setup(model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_an_init_that_cannot_be_reproduced_raises_on_every_rank() -> None:
    for message in run_distributed(never_initialized_on_ranks, 2, 2, timeout=120):
        assert "parameter 'weight' of NoInit" in message and "never initialized" in message


def init_after_the_block_on_ranks(rank: int, world_size: int) -> str:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    torch.nn.init.normal_(model[1].weight, std=0.02)  # after the block: not recorded
    try:
        acc.setup(model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_init_written_after_the_block_raises_on_every_rank() -> None:
    for message in run_distributed(init_after_the_block_on_ranks, 2, 2, timeout=120):
        assert "parameter '1.weight' of Sequential" in message and "changed in place after" in message
