"""torch.compile in one process: the option, a user's torch.compile(model), clean names, bad input.

These use torch.compile's "eager" backend (dynamo only, no code generation): they check the wiring in
a second; the numerics under inductor are checked on 2 FSDP ranks in tests/distributed/test_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator, DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from tests.models import GPT, GPTConfig, gpt_loss, token_batches

EAGER = {"backend": "eager"}


def _losses(acc: Accelerator, model: torch.nn.Module, steps: int = 3) -> tuple[list[float], torch.nn.Module]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    losses = []
    for batch in token_batches(steps, 2, GPTConfig()):
        loss = gpt_loss(model, batch)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _is_compiled(module: torch.nn.Module) -> bool:
    return module._compiled_call_impl is not None


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


@pytest.mark.parametrize("how", ["option", "user"])
def test_single_device_compile_trains_like_eager_with_clean_names(how: str) -> None:
    acc = Accelerator(
        accelerator="cpu", strategy=SingleDeviceStrategy(compile=EAGER if how == "option" else False)
    )
    acc.launch()
    eager, _ = _losses(Accelerator(accelerator="cpu", strategy="single"), _gpt())
    model = _gpt() if how == "option" else torch.compile(_gpt(), **EAGER)
    compiled, wrapped = _losses(acc, model)
    assert compiled == eager
    assert _is_compiled(wrapped._forward_module)
    assert not any("_orig_mod" in key for key in wrapped.state_dict())
    assert [n for n, _ in wrapped.named_parameters() if "_orig_mod" in n] == []


def test_fsdp_compiles_each_block_not_the_root(caplog: pytest.LogCaptureFixture) -> None:
    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(), devices=1)
    acc.launch()
    with caplog.at_level("INFO", logger="minifabric.strategies.fsdp"):
        _, model = _losses(acc, torch.compile(_gpt(), **EAGER), steps=1)
    assert "torch.compile(model) was unwrapped" in caplog.text
    assert all(_is_compiled(block) for block in model.module.blocks)
    assert not _is_compiled(model.module)
    assert not any("_orig_mod" in key for key in model.state_dict())


@pytest.mark.parametrize("strategy", [SingleDeviceStrategy, DDPStrategy, FSDPStrategy])
@pytest.mark.parametrize(("value", "match"), [("yes", "compile must be True"), ({"modee": "x"}, "'modee'")])
def test_bad_compile_option_raises_at_construction(strategy: type, value: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        strategy(compile=value)
