"""Lightning Fabric's checkpoint keywords: save(filter=), load(weights_only=), load_raw(weights_only=),
and the Fabric checkpoints that load."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from minifabric import Accelerator, CheckpointError
from minifabric.checkpoint.format import FORMAT_KEY, make_ref


def _acc() -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    return acc


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_save_filter_keeps_only_the_items_it_accepts(tmp_path: Path, fmt: str) -> None:
    acc = _acc()
    acc.strategy.state_dict_type = fmt
    model = acc.setup(nn.Linear(3, 2))
    path = tmp_path / ("ckpt.pt" if fmt == "full" else "ckpt")
    state = {"model": model, "hparams": {"lr": 0.1, "name": "run"}, "step": 4}
    acc.save(path, state, filter={"model": lambda k, v: "weight" in k, "hparams": lambda k, v: k == "lr"})
    loaded = acc.load(path)
    assert set(loaded["model"]) == {"weight"} and torch.equal(loaded["model"]["weight"], model.weight)
    assert loaded["hparams"] == {"lr": 0.1} and loaded["step"] == 4


def test_save_filter_is_checked_as_fabric_checks_it(tmp_path: Path) -> None:
    acc = _acc()
    model = acc.setup(nn.Linear(3, 2))
    with pytest.raises(TypeError, match="filter"):
        acc.save(tmp_path / "a.pt", {"model": model}, filter=lambda k, v: True)
    with pytest.raises(ValueError, match="not present in the state keys"):
        acc.save(tmp_path / "a.pt", {"model": model}, filter={"modle": lambda k, v: True})
    with pytest.raises(TypeError, match="callable"):
        acc.save(tmp_path / "a.pt", {"model": model}, filter={"model": "weight"})
    assert not (tmp_path / "a.pt").exists()


def test_weights_only_false_unpickles_only_when_asked(tmp_path: Path) -> None:
    acc = _acc()
    model = nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=0.1)}, tmp_path / "fabric.ckpt")
    fresh = acc.setup(nn.Linear(3, 2))
    for weights_only in (None, True):
        with pytest.raises(
            CheckpointError, match=r"arbitrary classes.*argparse\.Namespace.*weights_only=False"
        ):
            acc.load(tmp_path / "fabric.ckpt", {"model": fresh}, weights_only=weights_only)
    rest = acc.load(tmp_path / "fabric.ckpt", {"model": fresh}, weights_only=False)
    assert torch.equal(fresh.weight, model.weight) and rest["args"].lr == 0.1
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=0.1)}, tmp_path / "raw.pt")
    other = acc.setup(nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match="arbitrary classes"):
        acc.load_raw(tmp_path / "raw.pt", other)
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    acc.load_raw(tmp_path / "plain.pt", other, weights_only=False)
    assert torch.equal(other.weight, model.weight)


def test_a_one_file_fabric_checkpoint_of_plain_values_loads(tmp_path: Path) -> None:
    torch.save({"step": 3, "lr": 0.5, "name": "run"}, tmp_path / "values.ckpt")  # what fabric.save writes
    acc = _acc()
    state = {"step": 0}
    rest = acc.load(tmp_path / "values.ckpt", state)
    assert state == {"step": 3} and rest == {"lr": 0.5, "name": "run"}
    torch.save(nn.Linear(3, 2).state_dict(), tmp_path / "weights.pt")  # a plain state dict: load_raw
    with pytest.raises(CheckpointError, match=r"not a minifabric checkpoint.*load_raw"):
        acc.load(tmp_path / "weights.pt", {"step": 0})


def test_a_one_file_checkpoint_with_tensor_references_is_refused(tmp_path: Path) -> None:
    meta = {"version": 2, "format": "full", "world_size": 1, "kinds": {"w": "value"}, "ranks": []}
    torch.save({FORMAT_KEY: meta, "state": {"w": make_ref("w", torch.zeros(3))}}, tmp_path / "broken.pt")
    with pytest.raises(CheckpointError, match=r"references to tensors.*minifabric consolidate"):
        _acc().load(tmp_path / "broken.pt")
