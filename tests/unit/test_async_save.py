import errno
import time

import pytest
import torch

import minifabric.checkpoint.service as service
import minifabric.checkpoint.writer as writer
from minifabric import Accelerator, CheckpointError


def _slow_stage(monkeypatch, seconds=0.5):
    real = service.stage

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "stage", slow)


def test_async_save_returns_before_the_copy_and_the_next_step_waits_for_it(tmp_path, monkeypatch):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _slow_stage(monkeypatch)

    start = time.perf_counter()
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer}, asynchronous=True)
    returned = time.perf_counter() - start
    acc.backward(model(torch.randn(4, 8)).sum())  # forward and backward overlap the copy
    optimizer.step()  # must wait until the copy of the pre-step weights is complete
    handle.wait()

    assert returned < 0.4  # the copy happens in the background
    assert not torch.equal(model.weight, saved["weight"])
    fresh = torch.nn.Linear(8, 8)
    acc.load_raw(tmp_path / "ckpt.pt", fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_no_step_hook_is_left_behind_after_the_save_completes(tmp_path):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.save(tmp_path / "a.pt", {"model": model, "optimizer": optimizer}, asynchronous=True)
    acc.save(tmp_path / "b.pt", {"model": model, "optimizer": optimizer})  # waits for the first
    assert not optimizer.optimizer._optimizer_step_pre_hooks


@pytest.mark.parametrize("then", ["save", "load"])
@pytest.mark.parametrize("fault", ["copy", "write"])
def test_a_failed_background_save_surfaces_at_the_next_save_or_load(tmp_path, monkeypatch, fault, then):
    """Nobody waited for the handle: the next ``save`` or ``load`` raises the failure, writing nothing."""
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    model = acc.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    acc.save(tmp_path / "good", {"model": model})

    def fails(*args, **kwargs):
        if fault == "copy":
            raise MemoryError("host memory exhausted while copying")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(*((service, "stage") if fault == "copy" else (writer, "save_without_crc32")), fails)
    handle = acc.save(tmp_path / "bad", {"model": model}, asynchronous=True)
    while not handle.done():
        time.sleep(0.01)
    monkeypatch.undo()
    cause = "host memory exhausted" if fault == "copy" else "No space left on device"
    with pytest.raises(CheckpointError, match=cause):
        if then == "save":
            acc.save(tmp_path / "next", {"model": model})
        else:
            acc.load(tmp_path / "good", {"model": model})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]  # nothing half-written, "next" not begun
    acc.save(tmp_path / "next", {"model": model})  # reported once: the next save runs
    acc.load(tmp_path / "next", {"model": model})
