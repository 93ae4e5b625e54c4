"""The on-disk format: version check on open, and shard writing that leaves torch's switches alone."""

from __future__ import annotations

import io
import os
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from minifabric.checkpoint import CheckpointError
from minifabric.checkpoint.commit import locate
from minifabric.checkpoint.format import FORMAT_KEY, FORMAT_VERSION, SIDE_RECORD


def _acc(state_dict_type: str) -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    acc.strategy.state_dict_type = state_dict_type
    return acc


def _bump_version(path: Path, fmt: str) -> None:
    """Rewrite the checkpoint's format version to the next one (as a newer minifabric would write it)."""
    record = locate(path) / SIDE_RECORD if fmt == "sharded" else path
    data = torch.load(record, weights_only=True)
    data[FORMAT_KEY]["version"] = FORMAT_VERSION + 1
    torch.save(data, record)
    if fmt == "sharded":  # keep the commit record's sizes true
        import json

        commit = locate(path) / "COMMIT.json"
        meta = json.loads(commit.read_text())
        meta["files"][SIDE_RECORD] = record.stat().st_size
        commit.write_text(json.dumps(meta))


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_checkpoint_of_a_newer_format_is_refused_naming_both_versions(tmp_path: Path, fmt: str) -> None:
    acc = _acc(fmt)
    model = acc.setup(nn.Linear(3, 2))
    path = tmp_path / ("ckpt" if fmt == "sharded" else "ckpt.pt")
    acc.save(path, {"model": model, "step": 1})
    _bump_version(path, fmt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=rf"version {FORMAT_VERSION + 1}.*up to {FORMAT_VERSION}.*Upgrade"
    ):
        acc.load(path, {"model": model})
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def _has_crc32(data: bytes) -> bool:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
        return bool(records) and all(info.CRC != 0 for info in records) and archive.testzip() is None


def test_a_users_torch_save_during_a_background_save_keeps_its_crc32(tmp_path: Path, monkeypatch) -> None:
    acc = _acc("sharded")
    model = acc.setup(nn.Linear(64, 64))
    in_write, user_saved = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the shard files are fsynced while the shards are being written
        if threading.current_thread().name == "minifabric-save" and not in_write.is_set():
            in_write.set()
            user_saved.wait(timeout=30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    handle = acc.save(tmp_path / "ckpt", {"model": model}, asynchronous=True)
    assert in_write.wait(timeout=30)
    buffer = io.BytesIO()
    try:
        torch.save({"w": torch.arange(1000.0)}, buffer)  # the user's own save, on the main thread
        assert torch.serialization.get_crc32_options()
    finally:
        user_saved.set()
        handle.wait()
    assert _has_crc32(buffer.getvalue())
    fresh = nn.Linear(64, 64)
    acc.load(tmp_path / "ckpt", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_shards_are_written_without_crc32_and_read_back(tmp_path: Path) -> None:
    acc = _acc("sharded")
    model = acc.setup(nn.Linear(8, 8))
    acc.save(tmp_path / "ckpt", {"model": model})
    shard = next(locate(tmp_path / "ckpt").glob("*.distcp"))
    assert shard.stat().st_size > 0
    fresh = nn.Linear(8, 8)
    acc.load(tmp_path / "ckpt", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.serialization.get_crc32_options()


def test_the_core_save_and_load_path_does_not_import_the_hugging_face_package() -> None:
    import subprocess
    import sys

    code = (
        "import sys, minifabric.checkpoint.service, minifabric.checkpoint.save, minifabric.checkpoint.load;"
        " print(sorted(m for m in sys.modules if m.startswith('minifabric.checkpoint.hf')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
