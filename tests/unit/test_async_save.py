import errno
import time

import pytest
import torch

import minifabric.checkpoint.service as service
import minifabric.checkpoint.tensors as tensors
import minifabric.checkpoint.writer as writer
from minifabric import Accelerator, CheckpointError


def _slow_stage(monkeypatch, seconds=0.5):
    real = service.stage

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "stage", slow)


def test_async_save_writes_the_state_at_the_call_whatever_changes_in_place_after_it(tmp_path, monkeypatch):
    """A step, a hand-written update, a clamp and a tensor among ``state``'s values changed in place
    after the call returns never reach the checkpoint (the copy is slowed down, so a copy taken
    after the call would see them)."""
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()
    ema = torch.arange(4.0)
    extra = {"seen": {1, 2}}
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    _slow_stage(monkeypatch)

    handle = acc.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "ema": ema, "extra": extra},
                      asynchronous=True)  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # SAM's first step, or an update by hand
            p.data.clamp_(-0.5, 0.5)
    ema.mul_(0)
    extra["seen"].add(3)
    acc.backward(model(torch.randn(4, 8)).sum())  # the forward updates BatchNorm's running statistics
    optimizer.step()
    handle.wait()

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = {"model": fresh, "optimizer": fresh_opt, "ema": None, "extra": None}
    acc.load(tmp_path / "ckpt.pt", state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved_model[key]), key
    for p, moment in zip(fresh.parameters(), saved_moments, strict=True):
        assert torch.equal(fresh_opt.state[p]["exp_avg"], moment)
    assert torch.equal(state["ema"], torch.arange(4.0))
    assert state["extra"] == {"seen": {1, 2}}


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


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
@pytest.mark.parametrize(
    "values",
    [
        pytest.param(lambda a, b: {"a/b": a, "a": {"b": b}}, id="slash-in-a-key"),
        pytest.param(lambda a, b: {0: a, "0": b}, id="int-and-str-key"),
    ],
)
def test_async_save_keeps_leaves_whose_joined_paths_coincide_apart(tmp_path, strategy, values):
    """Two tensors of one shape whose paths read alike once joined get a buffer each: both are saved."""
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    for _ in range(2):  # the second save reuses the first one's buffers
        handle = acc.save(tmp_path / "ckpt", {"model": model, "vals": values(torch.ones(3), torch.full((3,), 2.0))},
                          asynchronous=True)  # fmt: skip
        handle.wait()
        state = {"model": model, "vals": None}
        acc.load(tmp_path / "ckpt", state)
        assert tensors.equal(state["vals"], values(torch.ones(3), torch.full((3,), 2.0)))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_sharded_save_refuses_two_dtensors_whose_keys_join_alike(tmp_path, asynchronous):
    """DTensors among plain values go to the shard files by joined path: one would be read back for both."""
    acc = Accelerator(accelerator="cpu", devices=1, strategy="fsdp")
    acc.launch()
    model = acc.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    weights = model.state_dict()
    values = {"a/b": weights["0.weight"], "a": {"b": weights["1.weight"]}}
    with pytest.raises(CheckpointError, match="one key 'vals/a/b'"):
        handle = acc.save(tmp_path / "ckpt", {"model": model, "vals": values}, asynchronous=asynchronous)
        if handle is not None:
            handle.wait()
    assert not (tmp_path / "ckpt").exists()


def test_async_save_copies_a_sparse_tensor_as_a_sparse_one(tmp_path):
    """A dense buffer cannot hold it: the synchronous save wrote it, the asynchronous one failed."""
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    sparse = torch.eye(3).to_sparse()
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model, "adjacency": sparse}, asynchronous=True)
    sparse.values().mul_(5)  # changed in place after the call
    handle.wait()
    state = {"model": model, "adjacency": None}
    acc.load(tmp_path / "ckpt.pt", state)
    assert state["adjacency"].is_sparse
    assert torch.equal(state["adjacency"].to_dense(), torch.eye(3))


def test_ctrl_c_during_the_copy_of_an_async_save_is_raised_by_the_call(tmp_path, monkeypatch):
    """It was kept as the save's failure: the call returned a handle and training went on."""
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(service, "stage", interrupted)
    with pytest.raises(KeyboardInterrupt):
        acc.save(tmp_path / "ckpt.pt", {"model": model}, asynchronous=True)
    monkeypatch.undo()
    acc.save(tmp_path / "ckpt.pt", {"model": model}, asynchronous=True).wait()  # nothing pending is left
    assert (tmp_path / "ckpt.pt").is_file()


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_a_save_under_inference_mode_and_the_next_one_outside_it_both_complete(tmp_path, strategy):
    """Under inference_mode a sharded state_dict() failed, and the kept copies became inference
    tensors that the next asynchronous save, outside that mode, could not write into."""
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    with torch.inference_mode():  # e.g. a save at the end of an evaluation loop
        acc.save(tmp_path / "eval", {"model": model, "t": torch.ones(2)}, asynchronous=True).wait()
        acc.save(tmp_path / "eval-sync", {"model": model, "t": torch.ones(2)})
    acc.save(tmp_path / "train", {"model": model, "t": torch.full((2,), 2.0)}, asynchronous=True).wait()
    for name, value in (("eval", 1.0), ("eval-sync", 1.0), ("train", 2.0)):
        state = {"model": model, "t": None}
        acc.load(tmp_path / name, state)
        assert torch.equal(state["t"], torch.full((2,), value))


def test_async_save_keeps_only_the_last_saves_copies(tmp_path):
    """A value saved once (a key that names its step) must not hold its CPU copy for the rest of the run."""
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    kept = []
    for step in range(3):
        acc.save(tmp_path / "ckpt.pt", {"model": model, f"loss-{step}": torch.ones(1000)}, asynchronous=True).wait()
        kept.append(sum(buffer.numel() for buffer in acc._checkpointer._staging.buffers.values()))
    assert kept[0] == kept[1] == kept[2]


def test_the_kept_copies_go_with_the_accelerator(tmp_path):
    """The exit report of a failed save held the checkpointer, and with it a copy of the state
    (page-locked on a GPU), until the interpreter ended: one more per Accelerator of a sweep."""
    import gc
    import weakref

    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    acc.save(tmp_path / "ckpt.pt", {"model": model}, asynchronous=True).wait()
    kept = [weakref.ref(buffer) for buffer in acc._checkpointer._staging.buffers.values()]
    assert kept
    del acc, model
    gc.collect()
    assert [ref for ref in kept if ref() is not None] == []


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_async_save_keeps_values_that_share_a_tensor_sharing_it_as_the_synchronous_save_does(tmp_path, strategy):
    acc = Accelerator(accelerator="cpu", devices=1, strategy=strategy)
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    ema, seen = torch.ones(3), {1, 2}
    for asynchronous in (False, True):
        values = {"ema": ema, "alias": ema, "seen": seen, "seen again": seen}
        handle = acc.save(tmp_path / f"{asynchronous}", {"model": model, "v": values}, asynchronous=asynchronous)
        if handle is not None:
            handle.wait()
        state = {"model": model, "v": None}
        acc.load(tmp_path / f"{asynchronous}", state)
        assert state["v"]["ema"] is state["v"]["alias"] or (
            state["v"]["ema"].data_ptr() == state["v"]["alias"].data_ptr()
        ), asynchronous
        assert state["v"]["seen"] is state["v"]["seen again"], asynchronous


def test_a_failed_copy_is_agreed_on_without_reading_the_state_training_changes_meanwhile(tmp_path, monkeypatch):
    """The background agreement on a failed copy carried the live state dicts of the stateful
    objects: pickled (as on 2+ ranks) after training had changed them, it failed with another
    error on that rank alone, and the other ranks waited for it until the timeout."""
    import pickle
    import threading

    import minifabric.checkpoint.save as saving
    from minifabric.checkpoint.comm import Comm

    class Counter:
        def __init__(self):
            self.state = {"seen": [1, 2]}

        def state_dict(self):
            return self.state  # its live state, as many state_dict()s return

        def load_state_dict(self, state):
            self.state = state

    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    counter = Counter()
    changed = threading.Event()
    real_agree = saving.agree_collected

    def agree_after_training_changed_the_state(job, payload):
        changed.wait(timeout=60)
        return real_agree(job, payload)

    def fails(*args, **kwargs):
        raise MemoryError("host memory exhausted while copying")

    monkeypatch.setattr(Comm, "all_gather", lambda self, obj: [pickle.loads(pickle.dumps(obj))])
    monkeypatch.setattr(saving, "agree_collected", agree_after_training_changed_the_state)
    monkeypatch.setattr(service, "stage", fails)
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model, "counter": counter}, asynchronous=True)
    counter.state["hook"] = lambda: None  # training goes on and changes the state after the call
    changed.set()
    with pytest.raises(CheckpointError, match="host memory exhausted while copying"):
        handle.wait()
    assert not (tmp_path / "ckpt.pt").exists()
