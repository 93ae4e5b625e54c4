"""Checkpoint behaviour in one process: validation before mutation, safe reading, refusal of
interrupted saves, clear path errors, optimizers without state, RNG and dataloader state."""

from __future__ import annotations

import json
import pickle
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from minifabric import Accelerator
from minifabric.checkpoint import CheckpointError, rng
from minifabric.checkpoint.commit import locate


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def _acc(state_dict_type: str = "sharded") -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    acc.strategy.state_dict_type = state_dict_type
    return acc


def _trained(acc: Accelerator, optimizer_cls: type = torch.optim.AdamW, **kwargs) -> tuple:
    torch.manual_seed(0)
    model = Small()
    optimizer = optimizer_cls(model.parameters(), lr=0.1, **kwargs)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(5, 4)).sum())
    optimizer.step()
    return model, optimizer


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_strict_key_errors_list_every_key_with_hints_and_change_nothing(tmp_path: Path) -> None:
    acc = _acc()
    model, optimizer = _trained(acc)
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    other = nn.ModuleDict({"layers": nn.Linear(4, 3), "head": nn.Linear(3, 2)})
    before = _weights(other)
    with pytest.raises(CheckpointError) as caught:
        acc.load(tmp_path / "ckpt", {"model": other, "optimiser": optimizer})
    message = str(caught.value)
    for key in ("optimiser (did you mean 'optimizer'?)", "model.layers.weight", "model.layers.bias",
                "model.layer.weight (did you mean 'layers.weight'?)", "model.layer.bias"):  # fmt: skip
        assert key in message
    assert "strict=False" in message
    for key, value in other.state_dict().items():
        assert torch.equal(value, before[key])


def test_non_strict_load_takes_matching_keys_and_reports_the_rest(tmp_path: Path) -> None:
    acc = _acc()
    model, _ = _trained(acc)
    acc.save(tmp_path / "ckpt", {"model": model, "extra": 3})
    target = nn.ModuleDict({"layer": nn.Linear(4, 3), "other": nn.Linear(3, 2)})
    with pytest.warns(UserWarning, match=r"model\.other\.weight.*model\.head\.weight|model\.head\.weight"):
        left = acc.load(tmp_path / "ckpt", {"model": target, "missing": 0}, strict=False)
    assert torch.equal(target["layer"].weight, model.layer.weight)
    assert left == {"extra": 3}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_shape_mismatch_is_named_and_model_unchanged(tmp_path: Path, fmt: str) -> None:
    acc = _acc(fmt)
    model, _ = _trained(acc)
    path = tmp_path / ("ckpt" if fmt == "sharded" else "ckpt.pt")
    acc.save(path, {"model": model})
    wrong = nn.ModuleDict({"layer": nn.Linear(4, 3), "head": nn.Linear(3, 7)})
    before = _weights(wrong)
    with pytest.raises(CheckpointError, match=r"model\.head\.weight: checkpoint \(2, 3\), model \(7, 3\)"):
        acc.load(path, {"model": wrong}, strict=False)
    assert all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())


def test_failed_tensor_read_leaves_model_unchanged(tmp_path: Path) -> None:
    acc = _acc()
    model, optimizer = _trained(acc)
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    shard = next(locate(tmp_path / "ckpt").glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size: passes the commit record, fails to read
    fresh, fresh_opt = _trained(acc)
    with torch.no_grad():
        fresh.layer.weight.add_(1.0)
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match="rank 0"):
        acc.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_opt})
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize(("fmt", "optimizer_cls", "kwargs", "step"), [
    ("full", torch.optim.SGD, {}, True),  # plain SGD: no state at all
    ("sharded", torch.optim.AdamW, {}, False),  # never stepped
    ("sharded", torch.optim.SGD, {"momentum": 0.9}, True),
])  # fmt: skip
def test_optimizers_with_empty_or_small_state_round_trip(
    tmp_path: Path, fmt, optimizer_cls, kwargs, step
) -> None:
    acc = _acc(fmt)
    torch.manual_seed(0)
    model = Small()
    optimizer = optimizer_cls(model.parameters(), lr=0.1, **kwargs)
    model, optimizer = acc.setup(model, optimizer)
    if step:
        acc.backward(model(torch.randn(5, 4)).sum())
        optimizer.step()
    path = tmp_path / ("ckpt" if fmt == "sharded" else "ckpt.pt")
    acc.save(path, {"model": model, "optimizer": optimizer})
    assert optimizer.state_dict()["state"] == {} or step  # saving did not create state
    other = Small()
    other_opt = optimizer_cls(other.parameters(), lr=0.5, **kwargs)
    acc.load(path, {"model": other, "optimizer": other_opt})
    assert other_opt.param_groups[0]["lr"] == 0.1
    assert torch.equal(other.head.weight, model.head.weight)
    for index, values in optimizer.state_dict()["state"].items():
        for name, value in values.items():
            assert torch.equal(other_opt.state_dict()["state"][index][name], value)


def test_uncommitted_or_incomplete_folders_are_refused(tmp_path: Path) -> None:
    acc = _acc()
    model, _ = _trained(acc)
    acc.save(tmp_path / "ckpt", {"model": model})
    version = locate(tmp_path / "ckpt")
    (version / "COMMIT.json").rename(tmp_path / "record.json")
    with pytest.raises(CheckpointError, match="interrupted save"):
        acc.load(tmp_path / "ckpt", {"model": model})
    record = json.loads((tmp_path / "record.json").read_text())
    (tmp_path / "record.json").rename(version / "COMMIT.json")
    shard = next(name for name in record["files"] if name.endswith(".distcp"))
    (version / shard).write_bytes(b"short")
    with pytest.raises(CheckpointError, match=f"incomplete: {shard} has 5 bytes"):
        acc.load(tmp_path / "ckpt", {"model": model})
    with pytest.raises(CheckpointError, match="does not exist"):
        acc.load(tmp_path / "nothing", {"model": model})


def test_path_errors_come_before_anything_is_written(tmp_path: Path) -> None:
    acc = _acc()
    model, _ = _trained(acc)
    (tmp_path / "file").write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="holds no minifabric checkpoint"):
        acc.save(tmp_path / "data", {"model": model})
    with pytest.raises(CheckpointError, match="not a writable directory"):
        acc.save(tmp_path / "file" / "below", {"model": model})
    acc.strategy.state_dict_type = "full"
    with pytest.raises(CheckpointError, match="it is a directory"):
        acc.save(tmp_path / "data", {"model": model})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "file"]
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("tag", ["", "[lr=0.1]"])  # glob characters in a name are plain text
def test_a_sharded_save_replaces_a_one_file_checkpoint_and_survives_a_crash_between(
    tmp_path: Path, tag: str
) -> None:
    acc = _acc("full")
    model, _ = _trained(acc)
    path = tmp_path / f"ckpt{tag}.pt"
    acc.save(path, {"model": model, "step": 1})
    acc.strategy.state_dict_type = "sharded"
    acc.save(path, {"model": model, "step": 2})
    assert path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [f"ckpt{tag}.pt"]
    state = {"model": Small(), "step": 0}
    acc.load(path, state)
    assert state["step"] == 2 and torch.equal(state["model"].head.weight, model.head.weight)
    # a crash after the file was moved aside, before the folder took its place: the file still loads
    aside = tmp_path / f".other{tag}.pt.previous-0123abcd"
    acc.strategy.state_dict_type = "full"
    acc.save(aside, {"model": model, "step": 3})
    acc.load(tmp_path / f"other{tag}.pt", state)
    assert state["step"] == 3
    acc.save(tmp_path / f"other{tag}.pt", {"model": model, "step": 4})  # the next save clears it
    assert not aside.exists()


class _Boom:
    def __reduce__(self):
        return (print, ("code ran",))


def test_metadata_that_would_run_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    acc = _acc()
    model, _ = _trained(acc)
    acc.save(tmp_path / "ckpt", {"model": model})
    version = locate(tmp_path / "ckpt")
    metadata = version / ".metadata"
    metadata.write_bytes(pickle.dumps(_Boom()))
    record = json.loads((version / "COMMIT.json").read_text())
    record["files"][".metadata"] = metadata.stat().st_size
    (version / "COMMIT.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="not allowed"):
        acc.load(tmp_path / "ckpt", {"model": model})
    assert "code ran" not in capsys.readouterr().out


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(rng.capture(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)
    assert rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True)) == []
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


def test_dataloader_resumes_at_the_next_unseen_batch_and_maps_world_sizes() -> None:
    acc = _acc()
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    iterator = iter(loader)
    seen = [next(iterator)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [batch[0].tolist() for batch in iterator]
    assert state == {"epoch": 0, "samples_seen": 6, "num_replicas": 1, "consumed": 6, "seed": 0,
                     "shuffle": True, "drop_last": False, "dataset_size": 20}  # fmt: skip
    other = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    other.load_state_dict(state)
    assert [batch[0].tolist() for batch in other] == rest
    assert sorted(i for batch in seen + rest for i in batch) == list(range(20))
    other.load_state_dict({"epoch": 1, "samples_seen": 3, "num_replicas": 3})  # 9 samples seen in all
    assert sum(len(batch[0]) for batch in other) == 20 - 9


def test_a_position_loaded_while_a_pass_runs_is_where_that_pass_goes_on() -> None:
    acc = _acc()
    ahead = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    ahead_batches = iter(ahead)
    [next(ahead_batches) for _ in range(4)]
    state = ahead.state_dict()  # 8 samples consumed
    rest = [batch[0].tolist() for batch in ahead_batches]
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20)), batch_size=2, shuffle=True))
    running = iter(loader)
    next(running)
    loader.load_state_dict(state)  # e.g. a replica group that heals from a live one
    assert [batch[0].tolist() for batch in running] == rest  # the same pass, from the loaded position
    assert loader.state_dict()["epoch"] == 1
    assert len([batch for batch in loader]) == 10  # the next pass is a whole epoch again


@pytest.mark.parametrize(("fmt", "suffix"), [("sharded", ""), ("full", ".pt"), ("full", "")])
def test_keep_last_and_latest_checkpoint(tmp_path: Path, fmt: str, suffix: str) -> None:
    from argparse import Namespace

    from minifabric import latest_checkpoint

    acc = _acc(fmt)
    model, _ = _trained(acc)
    root = tmp_path / "ckpts"
    assert latest_checkpoint(root) is None
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "a.txt").write_text("not a checkpoint of the series")
    for step in range(1, 5):
        acc.save(root / f"step-{step:04d}{suffix}", {"model": model, "step": step}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["notes", f"step-0003{suffix}", f"step-0004{suffix}"]
    assert latest_checkpoint(root) == root / f"step-0004{suffix}"
    with pytest.raises(CheckpointError, match="args"):  # a failed save deletes nothing
        acc.save(root / f"step-0005{suffix}", {"model": model, "args": Namespace()}, keep_last=1)
    assert latest_checkpoint(root) == root / f"step-0004{suffix}"
    assert len(list(root.iterdir())) == 3
    with pytest.raises(ValueError, match="keep_last"):
        acc.save(root / "x", {"model": model}, keep_last=0)


def test_a_lightning_fabric_one_file_checkpoint_resumes_with_load(tmp_path: Path) -> None:
    from argparse import Namespace

    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(5, 4)).sum())
    optimizer.step()
    scheduler.step()
    fabric.save(
        tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "sched": scheduler, "step": 3}
    )

    acc = _acc()
    fresh = Small()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    state = {"model": fresh, "optimizer": fresh_opt, "sched": fresh_sched, "step": 0}
    acc.load(tmp_path / "fabric.ckpt", state)
    assert state["step"] == 3 and fresh_sched.last_epoch == 1 and fresh_opt.param_groups[0]["lr"] == 0.05
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    live = optimizer.optimizer.state[model.module.layer.weight]["exp_avg"]
    assert torch.equal(fresh_opt.state[fresh.layer.weight]["exp_avg"], live)

    torch.save({"model": model.state_dict(), "hparams": Namespace(lr=1)}, tmp_path / "pickled.ckpt")
    with pytest.raises(CheckpointError, match=r"arbitrary classes.*argparse\.Namespace"):
        acc.load(tmp_path / "pickled.ckpt", {"model": fresh})


def _saved_once(tmp_path: Path) -> tuple[Accelerator, nn.Module, Path, str]:
    """A sharded checkpoint at ``tmp_path / "ckpt"``; returns the accelerator, model, path and version."""
    acc = _acc("sharded")
    model, _ = _trained(acc)
    path = tmp_path / "ckpt"
    acc.save(path, {"model": model, "step": 1})
    return acc, model, path, (path / "LATEST").read_text()


def _only_the_latest_version(path: Path) -> bool:
    from minifabric.checkpoint.commit import wait_for_cleanup

    wait_for_cleanup()
    return sorted(p.name for p in path.iterdir()) == sorted(["LATEST", (path / "LATEST").read_text()])


def test_the_replaced_version_is_deleted_in_the_background_and_the_next_save_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from minifabric.checkpoint import commit as commits

    acc, model, path, first = _saved_once(tmp_path)
    events: list[str] = []
    release = threading.Event()
    remove, make_staging = commits._remove, commits.make_staging

    def slow_remove(entries: list[Path]) -> None:
        release.wait(30)
        remove(entries)
        events.append("removed " + ",".join(e.name for e in entries))

    def staging(p: Path) -> commits.Staging:
        events.append("staging")
        return make_staging(p)

    monkeypatch.setattr(commits, "_remove", slow_remove)
    monkeypatch.setattr(commits, "make_staging", staging)
    acc.save(path, {"model": model, "step": 2})  # returns while the old version is still being deleted
    second = (path / "LATEST").read_text()
    (trash,) = tmp_path.glob(".ckpt.removing-*")  # set aside beside path, deleted from there
    assert events == ["staging"] and (trash / first).is_dir()
    state = {"model": Small(), "step": 0}
    acc.load(path, state)  # the deletion in progress never touches what LATEST names
    assert state["step"] == 2
    threading.Timer(0.2, release.set).start()
    acc.save(path, {"model": model, "step": 3})  # waits for the deletion before it stages
    assert events[:3] == ["staging", f"removed {trash.name}", "staging"]
    assert _only_the_latest_version(path)
    assert not (path / second).exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_failed_deletion_of_the_replaced_version_keeps_the_save_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from minifabric.checkpoint import commit as commits

    acc, model, path, first = _saved_once(tmp_path)
    rmtree = shutil.rmtree

    def refuse(entry, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(entry))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    acc.save(path, {"model": model, "step": 2})  # nothing raised: the checkpoint is committed
    commits.wait_for_cleanup()
    (trash,) = tmp_path.glob(".ckpt.removing-*")
    assert (trash / first).is_dir()
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    acc.save(path, {"model": model, "step": 3})
    assert _only_the_latest_version(path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    state = {"model": Small(), "step": 0}
    acc.load(path, state)
    assert state["step"] == 3


def _hold_deletions(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the background deletion of replaced versions wait until the returned event is set."""
    from minifabric.checkpoint import commit as commits

    release, remove = threading.Event(), commits._remove

    def held(entries: list[Path]) -> None:
        release.wait(30)
        remove(entries)

    monkeypatch.setattr(commits, "_remove", held)
    return release


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_checkpoint_folder_holds_only_the_new_version_once_the_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """The replaced version is deleted in the background, yet not from inside ``path``: the folder can be
    copied (archived, uploaded) right after ``save`` returns or ``handle.wait()``, while the deletion runs."""
    import shutil

    from minifabric.checkpoint import commit as commits

    acc, model, path, _ = _saved_once(tmp_path)
    release = _hold_deletions(monkeypatch)
    try:
        handle = acc.save(path, {"model": model, "step": 2}, asynchronous=asynchronous)
        if handle is not None:
            handle.wait()
        assert sorted(p.name for p in path.iterdir()) == sorted(["LATEST", (path / "LATEST").read_text()])
        shutil.copytree(path, tmp_path / "copy")
    finally:
        release.set()
        commits.wait_for_cleanup()
    state = {"model": Small(), "step": 0}
    acc.load(tmp_path / "copy", state)
    assert state["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "copy"]


@pytest.mark.timeout(60)
def test_a_commit_that_cannot_start_a_thread_deletes_the_replaced_version_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.12 refuses new threads while the interpreter shuts down, when a background save that a
    script left running commits: the save still succeeds (it is committed) and cleans up."""
    from types import SimpleNamespace

    from minifabric import process

    class NoNewThreads(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't create new thread at interpreter shutdown")

    acc, model, path, _ = _saved_once(tmp_path)
    # the commit's cleanup thread is started by minifabric.process (one cleanup thread per process)
    monkeypatch.setattr(process, "threading", SimpleNamespace(**{**vars(threading), "Thread": NoNewThreads}))
    acc.save(path, {"model": model, "step": 2})  # committed: nothing may fail the save after that
    assert _only_the_latest_version(path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    state = {"model": Small(), "step": 0}
    acc.load(path, state)
    assert state["step"] == 2


@pytest.mark.timeout(60)
def test_a_replaced_version_left_by_a_killed_deletion_is_removed_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minifabric import latest_checkpoint
    from minifabric.checkpoint import commit as commits

    acc = _acc("sharded")
    model, _ = _trained(acc)
    path = tmp_path / "ckpts" / "step-1"
    acc.save(path, {"model": model, "step": 1})
    with monkeypatch.context() as patch:
        patch.setattr(commits, "_remove", lambda entries: None)  # killed before the thread deleted anything
        acc.save(path, {"model": model, "step": 2})
        commits.wait_for_cleanup()
    (left,) = [p.name for p in path.parent.iterdir() if p != path]
    assert left.startswith(".step-1.removing-")
    assert latest_checkpoint(path.parent) == path  # never taken for a checkpoint
    state = {"model": Small(), "step": 0}
    acc.load(path, state)
    assert state["step"] == 2
    acc.save(path, {"model": model, "step": 3})
    commits.wait_for_cleanup()
    assert [p.name for p in path.parent.iterdir()] == ["step-1"]


@pytest.mark.timeout(60)
def test_keep_last_also_removes_what_a_killed_deletion_left_beside_an_older_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minifabric.checkpoint import commit as commits

    acc = _acc("sharded")
    model, _ = _trained(acc)
    root = tmp_path / "ckpts"
    acc.save(root / "step-1", {"model": model, "step": 1})
    with monkeypatch.context() as patch:
        patch.setattr(commits, "_remove", lambda entries: None)  # killed before the thread deleted anything
        acc.save(root / "step-1", {"model": model, "step": 1})
    assert len(list(root.glob(".step-1.removing-*"))) == 1
    acc.save(root / "step-2", {"model": model, "step": 2}, keep_last=1)
    commits.wait_for_cleanup()
    assert [p.name for p in root.iterdir()] == ["step-2"]
