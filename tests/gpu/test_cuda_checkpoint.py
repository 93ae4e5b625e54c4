"""Checkpoints on one GPU: save, load and async save; a GPU checkpoint loads on the CPU and the other way
round; Hugging Face safetensors load into CUDA shards. Each side runs in its own process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CFG, CUDA_MARKS, adam_moments, batches, cpu_state, train
from tests.helpers import run_distributed
from tests.models import GPT, gpt_optimizer

pytestmark = CUDA_MARKS


def _save(rank: int, device: str, strategy: str, path: str, asynchronous: bool) -> dict:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1)
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=strategy == "fsdp"):
        model = GPT(CFG)
    model, optimizer = acc.setup(model, gpt_optimizer(model))
    train(acc, model, optimizer, batches(2))
    state = {"model": model, "optimizer": optimizer, "step": 2}
    saved = {"model": cpu_state(model), "moments": adam_moments(model, optimizer)}
    handle = acc.save(path, state, asynchronous=asynchronous)
    if asynchronous:  # the save writes the state at the call: these steps must not reach the file
        train(acc, model, optimizer, batches(2))
        handle.wait()
    return saved


def _load(rank: int, device: str, strategy: str, path: str) -> dict:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1)
    acc.launch()
    torch.manual_seed(1)  # other weights than the saved ones
    with acc.init_module(empty_init=strategy == "fsdp"):
        model = GPT(CFG)
    model, optimizer = acc.setup(model, gpt_optimizer(model))
    train(acc, model, optimizer, batches(1))  # optimizer state exists, and differs
    state = {"model": model, "optimizer": optimizer, "step": 0}
    acc.load(path, state)
    devices = sorted({getattr(p, "_local_tensor", p).device.type for p in model.parameters()})
    return {"model": cpu_state(model), "moments": adam_moments(model, optimizer), "step": state["step"], "devices": devices}


def _assert_restored(saved: dict, loaded: dict) -> None:
    assert loaded["step"] == 2
    assert saved["model"].keys() == loaded["model"].keys()
    assert all(torch.equal(v, loaded["model"][k]) for k, v in saved["model"].items())
    assert saved["moments"].keys() == loaded["moments"].keys()
    assert all(torch.equal(v, loaded["moments"][k]) for k, v in saved["moments"].items())


# (where it is saved, where it is loaded): the strategy on each side
CASES = [
    (("cuda", "fsdp"), ("cuda", "fsdp")),
    (("cuda", "fsdp"), ("cpu", "single")),
    (("cuda", "single"), ("cpu", "fsdp")),
    (("cpu", "fsdp"), ("cuda", "fsdp")),
    (("cpu", "single"), ("cuda", "single")),
]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("source", "target"), CASES, ids=lambda case: "-".join(case))
def test_checkpoint_saved_on_one_device_loads_exactly_on_the_other(tmp_path: Path, source, target, asynchronous):
    if asynchronous and source[0] == "cpu":
        pytest.skip("the CPU tiers test asynchronous saves from the CPU")
    path = str(tmp_path / "ckpt")
    (saved,) = run_distributed(_save, 1, *source, path, asynchronous, timeout=240)
    (loaded,) = run_distributed(_load, 1, *target, path, timeout=240)
    _assert_restored(saved, loaded)
    assert loaded["devices"] == [target[0]]


def _load_safetensors(rank: int, device: str, path: str) -> dict:
    acc = Accelerator(accelerator=device, strategy="fsdp", devices=1)
    acc.launch()
    torch.manual_seed(1)
    with acc.init_module(empty_init=True):
        model = GPT(CFG)
    model = acc.setup(model)
    acc.load_raw(path, model)
    local = [p._local_tensor for p in model.parameters()]
    return {"model": cpu_state(model), "devices": sorted({t.device.type for t in local})}


def test_load_raw_of_safetensors_fills_the_cuda_shards(tmp_path: Path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    torch.manual_seed(0)
    source = GPT(CFG)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    (result,) = run_distributed(_load_safetensors, 1, "cuda", str(tmp_path / "model.safetensors"), timeout=240)
    assert result["devices"] == ["cuda"]
    expected = cpu_state(source)
    assert [k for k, v in expected.items() if not torch.equal(v, result["model"][k])] == []
