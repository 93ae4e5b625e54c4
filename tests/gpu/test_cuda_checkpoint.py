"""Checkpoints on one GPU: save, load and async save; a GPU checkpoint loads on the CPU and the other way
round; Hugging Face safetensors load into CUDA shards; the async save's staging (side stream,
page-locked buffers, the first save, the fallback). Each side runs in its own process."""

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


#: about a second of a spinning kernel: the device is still busy with it when the save's call returns
SLEEP_CYCLES = 2_000_000_000


def _save_during_training(rank: int, path: str, mode: str) -> dict:
    """Three async saves, each called while the device still runs work queued before it (a spin, then
    an in-place update that belongs to the state at the call), and followed at once by in-place writes
    and a step. ``mode``: "default"; "no-room" (no free device memory for the first save's device copy);
    "pin-fails" (page-locking raises, as at the host's limit)."""
    import warnings

    from minifabric import process
    from minifabric.checkpoint import staging
    from minifabric.checkpoint.tensors import map_tree

    if mode == "no-room":
        staging.DeviceCopies.free_bytes = lambda self, device: 0
    if mode == "pin-fails":

        def refuse(self, shape, dtype):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc refused, simulated)")

        staging.DeviceCopies.pin = refuse
    process._once.clear()
    taken_on: list[list[str]] = []  # the devices of the copy each background thread writes
    real_take = staging.Snapshot.take

    def take(self):
        tree = real_take(self)
        found: set[str] = set()
        map_tree(tree, lambda path, leaf: found.add(leaf.device.type) if isinstance(leaf, torch.Tensor) else None)
        taken_on.append(sorted(found))
        return tree

    staging.Snapshot.take = take
    acc = Accelerator(accelerator="cuda", strategy="fsdp", devices=1)
    acc.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.setup(model, optimizer)
    x = torch.randn(16, 2048, device=acc.device)

    def step() -> None:
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    out: dict = {"routes": [], "busy": [], "kept": [], "expected": []}
    kept = acc._checkpointer._staging
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            before = {"model": cpu_state(model), "moments": adam_moments(model, optimizer)}  # synchronizes
            torch.cuda._sleep(SLEEP_CYCLES)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # queued behind the spin: part of the state at the call
            handle = acc.save(f"{path}/{i}", {"model": model, "optimizer": optimizer}, asynchronous=True)
            # the device still spins: the call waited neither for it nor for the copy queued behind it
            out["busy"].append(not torch.cuda.current_stream().query())
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0)  # written in place right after the call: must not reach the checkpoint
            step()
            handle.wait()
            out["routes"].append(sorted(k for k, v in handle.staged.items() if k != "cpu" and v))
            out["kept"].append({str(k): (b.data_ptr(), b.is_pinned()) for k, b in kept.buffers.items()})
            expected = {k: v + 1.0 for k, v in before["model"].items()}
            out["expected"].append({"model": expected, "moments": before["moments"]})
    out["warnings"] = [str(w.message) for w in caught if "Page-locking" in str(w.message)]
    out["taken_on"] = taken_on
    out["loaded"] = []
    for i in range(3):
        acc.load(f"{path}/{i}", {"model": model, "optimizer": optimizer})
        out["loaded"].append({"model": cpu_state(model), "moments": adam_moments(model, optimizer)})
    return out


@pytest.mark.parametrize("mode", ["default", "no-room", "pin-fails"])
def test_async_save_on_cuda_holds_the_state_at_the_call_while_training_goes_on(tmp_path: Path, mode: str):
    """The copies run on a side stream (the call returns while the device is busy), the current stream
    waits for them (in-place writes right after the call do not reach the checkpoint), later saves
    reuse the page-locked buffers, and a failed page-locking falls back to pageable memory, warned once."""
    (out,) = run_distributed(_save_during_training, 1, str(tmp_path), mode, timeout=240)
    assert out["busy"] == [True, True, True]
    assert out["taken_on"] == [["cpu"]] * 3  # DTensor copies too: none went back to the device
    for expected, loaded in zip(out["expected"], out["loaded"], strict=True):
        for part in ("model", "moments"):
            assert expected[part].keys() == loaded[part].keys()
            assert [k for k, v in expected[part].items() if not torch.equal(v, loaded[part][k])] == []
    first = {"default": ["device"], "no-room": ["pageable"], "pin-fails": ["device"]}[mode]
    later = ["pageable"] if mode == "pin-fails" else ["page-locked"]
    assert out["routes"] == [first, later, later]
    first_kept, second, third = out["kept"]
    assert first_kept == second == third  # the buffers the first save's background thread made, reused
    pinned = [key for key, (_, is_pinned) in third.items() if is_pinned]
    if mode == "pin-fails":
        assert pinned == [] and len(out["warnings"]) == 1
        assert "cudaHostAlloc refused" in out["warnings"][0]
    else:
        assert len(pinned) >= 12 and out["warnings"] == []  # 4 parameters and their 2 moments each
