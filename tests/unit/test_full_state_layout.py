"""Full state into a sharded model or optimizer in one process (FSDP on 1 device): what is refused.

The equality with one process on 2 ranks is in tests/distributed/test_full_state_into_sharded.py.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from minifabric.checkpoint.errors import CheckpointError


def _fsdp_model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    model = nn.Linear(4, 3)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters()))
    acc.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    return model, optimizer


def _full(tree: dict) -> dict:
    return {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v for k, v in tree.items()}


def test_a_full_tensor_of_another_shape_is_refused_before_anything_is_loaded() -> None:
    model, _ = _fsdp_model_and_optimizer()
    before = _full(model.state_dict())
    wrong = {"weight": torch.zeros(3, 4), "bias": torch.zeros(5)}  # the weight first: it would be copied
    with pytest.raises(ValueError, match=r"bias: state dict \(5,\), model \(3,\). Nothing was loaded"):
        model.load_state_dict(wrong)
    for key, value in _full(model.state_dict()).items():
        assert torch.equal(value, before[key]), key


def test_assign_with_full_tensors_into_a_sharded_model_is_refused() -> None:
    model, _ = _fsdp_model_and_optimizer()
    with pytest.raises(ValueError, match=r"assign=True.*model.load_state_dict\(state_dict\)"):
        model.load_state_dict({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, assign=True)


def test_optimizer_state_that_cannot_follow_its_sharded_parameter_is_refused() -> None:
    model, optimizer = _fsdp_model_and_optimizer()
    full = torch.optim.AdamW(nn.Linear(4, 3).parameters()).state_dict()
    full["state"] = {
        0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4)},
        1: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(3)},
    }
    before = {i: dict(optimizer.state[p]) for i, p in enumerate(model.parameters())}
    with pytest.raises(ValueError, match=r"optimizer.state\[1\]\['exp_avg'\] has the shape \(2,\)"):
        optimizer.load_state_dict(full)
    for i, p in enumerate(model.parameters()):
        assert optimizer.state[p].keys() == before[i].keys()
        assert all(optimizer.state[p][k] is v for k, v in before[i].items())  # nothing replaced


def test_load_of_an_optimizer_state_dict_file_points_to_load_raw(tmp_path: Path) -> None:
    acc = Accelerator(accelerator="cpu", devices=1)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    model, optimizer = acc.setup(model, optimizer)
    with pytest.raises(CheckpointError, match=r"`acc.load_raw\(path, optimizer\)`") as raised:
        acc.load(tmp_path / "optimizer.pt", {"optimizer": optimizer})
    assert "strict=False" not in str(raised.value)
    acc.load_raw(tmp_path / "optimizer.pt", optimizer)  # the fix works


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"junk": torch.zeros(1)}, RuntimeError, r"unexpected key\(s\): \['junk'\]. Nothing was loaded"),
        ({"bias": None}, RuntimeError, r"missing key\(s\): \['bias'\]"),
        ({"bias": [0.0, 0.0, 0.0]}, ValueError, r"bias: state dict a list, model a tensor of \(3,\)"),
    ],
    ids=["unexpected-key", "missing-key", "not-a-tensor"],
)
def test_a_bad_key_under_strict_changes_nothing_in_a_sharded_model(bad, error, match) -> None:
    """torch's own load_state_dict copies every matching tensor and then raises: here nothing is copied."""
    model, _ = _fsdp_model_and_optimizer()
    before = _full(model.state_dict())
    full = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}
    full.update(bad)
    full = {k: v for k, v in full.items() if v is not None}
    with pytest.raises(error, match=match):
        model.load_state_dict(full)
    for key, value in _full(model.state_dict()).items():
        assert torch.equal(value, before[key]), key


def test_name_keyed_optimizer_state_is_refused_by_load_state_dict_and_matched_by_name_by_load_raw(
    tmp_path: Path,
) -> None:
    """The live optimizer lists the parameters in another order than the saved one: by position, every
    parameter would receive another one's moments."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    reference(torch.randn(2, 4)).sum().backward()
    reference_optimizer.step()
    named = get_optimizer_state_dict(reference, reference_optimizer, options=StateDictOptions(full_state_dict=True))
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    first, second = list(model[0].parameters()), list(model[1].parameters())
    model, optimizer = acc.setup(model, torch.optim.AdamW([*second, *first]))
    with pytest.raises(ValueError, match=r"keyed by parameter name.*acc.load_raw\(path, optimizer\)"):
        optimizer.load_state_dict(named)
    assert not optimizer.state  # nothing loaded
    torch.save(named, tmp_path / "named.pt")
    acc.load_raw(tmp_path / "named.pt", optimizer)
    names = ["1.weight", "1.bias", "0.weight", "0.bias"]
    for name, param in zip(names, optimizer.param_groups[0]["params"], strict=True):
        assert torch.equal(optimizer.state[param]["exp_avg"].full_tensor(), named["state"][name]["exp_avg"]), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_load_raw_into_a_fresh_optimizer_leaves_no_view_of_the_file(tmp_path: Path, strategy: str) -> None:
    """The file is read mapped; state no live tensor receives (a fresh optimizer's, `step`) is copied out."""
    reference = nn.Linear(64, 64)
    reference_optimizer = torch.optim.AdamW(reference.parameters())
    reference(torch.randn(2, 64)).sum().backward()
    reference_optimizer.step()
    torch.save(reference_optimizer.state_dict(), tmp_path / "optimizer.pt")
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=1)
    acc.launch()
    model = nn.Linear(64, 64)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters()))
    acc.load_raw(tmp_path / "optimizer.pt", optimizer)
    gc.collect()
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()
    for param, saved in zip(model.parameters(), reference_optimizer.state.values(), strict=True):
        moment = optimizer.state[param]["exp_avg"]
        assert torch.equal(moment.full_tensor() if strategy == "fsdp" else moment, saved["exp_avg"])


def test_an_unsharded_buffer_of_another_shape_is_refused_before_anything_is_loaded() -> None:
    """BatchNorm's statistics stay plain tensors under FSDP; torch copies the other tensors, then raises."""
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    model = acc.setup(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    before = _full(model.state_dict())
    full = {k: torch.zeros_like(v) for k, v in before.items()}
    full["1.running_mean"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"1.running_mean: state dict \(5,\), model \(3,\). Nothing was loaded"):
        model.load_state_dict(full, strict=False)
    for key, value in _full(model.state_dict()).items():
        assert torch.equal(value, before[key]), key


def test_a_load_post_hook_that_forgives_a_missing_key_still_loads_under_strict() -> None:
    """torch lets a load post-hook clear the incompatible keys; the check before the load defers to it."""
    model, _ = _fsdp_model_and_optimizer()

    def forgive(module, incompatible):
        incompatible.missing_keys.clear()

    model.module.register_load_state_dict_post_hook(forgive)  # the user's module, which loads
    model.load_state_dict({"weight": torch.zeros(3, 4)})  # no bias: forgiven
    assert torch.equal(model.weight.full_tensor(), torch.zeros(3, 4))
