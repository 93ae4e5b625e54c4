"""One-file checkpoints on a single device: round trip, leftovers, strict errors, raw files, bad paths."""

import pytest
import torch
from torch import nn

from minifabric import Accelerator, CheckpointError


class Counter:
    """A user object with state_dict()/load_state_dict()."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _trained(acc, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.setup(model, optimizer, scheduler=scheduler)
    acc.backward(model(torch.randn(4, 4)).sum())
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_round_trip_restores_everything_in_place(acc, tmp_path):
    model, optimizer, scheduler = _trained(acc, seed=0)
    path = tmp_path / "ckpt.pt"
    acc.save(
        path,
        {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "counter": Counter(5),
            "step": 7,
            "tensor": torch.arange(3),
            "extra": "kept",
        },
    )

    fresh = Accelerator(accelerator="cpu")
    model2, optimizer2, scheduler2 = _trained(fresh, seed=1)
    state = {
        "model": model2,
        "optimizer": optimizer2,
        "scheduler": scheduler2,
        "counter": Counter(),
        "step": 0,
        "tensor": None,
    }
    leftovers = fresh.load(path, state)

    assert leftovers == {"extra": "kept"}
    assert state["step"] == 7
    assert torch.equal(state["tensor"], torch.arange(3))
    assert state["counter"].count == 5
    assert state["model"] is model2  # restored in place
    for expected, actual in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(expected, actual)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    exp_avg = optimizer.state[next(iter(model.parameters()))]["exp_avg"]
    assert torch.equal(optimizer2.state[next(iter(model2.parameters()))]["exp_avg"], exp_avg)


def test_load_without_state_returns_everything(acc, tmp_path):
    acc.save(tmp_path / "ckpt.pt", {"step": 3, "loss": 0.5})
    assert acc.load(tmp_path / "ckpt.pt") == {"step": 3, "loss": 0.5}


def test_strict_load_names_missing_and_unexpected_keys(acc, tmp_path):
    acc.save(tmp_path / "ckpt.pt", {"model": acc.setup(nn.Linear(2, 2))})
    other = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"model\.0\.weight.*model\.weight.*strict=False"):
        acc.load(tmp_path / "ckpt.pt", {"model": other})


def test_strict_load_names_entries_missing_from_the_checkpoint(acc, tmp_path):
    acc.save(tmp_path / "ckpt.pt", {"model": acc.setup(nn.Linear(2, 2))})
    with pytest.raises(CheckpointError, match="missing from the checkpoint: optimizer"):
        acc.load(tmp_path / "ckpt.pt", {"model": nn.Linear(2, 2), "optimizer": Counter()})


def test_shape_mismatch_names_the_key_and_both_shapes(acc, tmp_path):
    acc.save(tmp_path / "ckpt.pt", {"model": acc.setup(nn.Linear(2, 2))})
    with pytest.raises(CheckpointError, match=r"model\.weight: checkpoint \(2, 2\), model \(3, 2\)"):
        acc.load(tmp_path / "ckpt.pt", {"model": nn.Linear(2, 3)})


def test_non_strict_load_takes_the_matching_keys(acc, tmp_path):
    source = nn.Linear(2, 2)
    acc.save(tmp_path / "ckpt.pt", {"model": acc.setup(source)})
    target = nn.Module()
    target.weight = nn.Parameter(torch.zeros(2, 2))
    target.other = nn.Parameter(torch.zeros(1))
    with pytest.warns(UserWarning, match=r"strict=False; not restored: missing, model\.other, model\.bias"):
        acc.load(tmp_path / "ckpt.pt", {"model": target, "missing": 1}, strict=False)
    assert torch.equal(target.weight, source.weight)


def test_load_raw_reads_a_plain_state_dict_file(acc, tmp_path):
    source = nn.Linear(3, 2)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    model = acc.setup(nn.Linear(3, 2))
    acc.load_raw(tmp_path / "weights.pt", model)
    assert torch.equal(model.weight, source.weight)
    with pytest.raises(CheckpointError, match=r"shape mismatch.*weight"):
        acc.load_raw(tmp_path / "weights.pt", nn.Linear(4, 2))


def test_load_raw_reads_the_model_of_a_minifabric_checkpoint(acc, tmp_path):
    model, optimizer, _ = _trained(acc)
    acc.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "step": 1})
    target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    acc.load_raw(tmp_path / "ckpt.pt", target)
    assert torch.equal(target[0].weight, model.module[0].weight)


def test_loading_a_path_that_is_not_a_checkpoint_raises(acc, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a checkpoint that can be loaded safely"):
        acc.load(tmp_path / "notes.txt", {})
    with pytest.raises(CheckpointError, match="does not exist"):
        acc.load(tmp_path / "missing.pt", {})
    torch.save({"weight": torch.zeros(1)}, tmp_path / "raw.pt")
    with pytest.raises(CheckpointError, match=r"not a minifabric checkpoint.*acc\.load_raw"):
        acc.load(tmp_path / "raw.pt", {})


def test_saving_to_a_non_writable_path_raises(acc, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is not a writable directory"):
        acc.save(tmp_path / "file" / "ckpt.pt", {"step": 1})
    with pytest.raises(CheckpointError, match="it is a directory"):
        acc.save(tmp_path, {"step": 1})


def test_a_failed_save_leaves_the_previous_file_whole(acc, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    acc.save(path, {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        acc.save(path, {"step": 2})
    monkeypatch.undo()
    assert acc.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_state_must_be_a_dict_of_names(acc, tmp_path):
    with pytest.raises(TypeError, match="state must be a dict"):
        acc.save(tmp_path / "ckpt.pt", [1])
    with pytest.raises(TypeError, match="state keys must be strings"):
        acc.save(tmp_path / "ckpt.pt", {1: 2})
