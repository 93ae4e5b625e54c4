"""The staging policy of an asynchronous save, on the CPU: which memory each copy goes into, and when it is allocated.

The CUDA calls (side streams, events, page-locking) go through ``staging.DeviceCopies``; here a fake
treats float64 tensors as device tensors and runs their copies only when an event is waited for,
as a device runs them later than the call. tests/gpu/test_cuda_checkpoint.py runs the real thing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import minifabric.checkpoint.service as service
import minifabric.checkpoint.staging as staging_module
from minifabric import Accelerator, CheckpointError, process
from minifabric.checkpoint.staging import DeviceCopies, Staging, stage


class FakeEvent:
    def __init__(self, device: FakeDevice, hold: bool) -> None:
        self.device, self.hold = device, hold

    def synchronize(self) -> None:
        self.device.log.append("synchronize")
        self.device.run_queued()


class FakeDevice(DeviceCopies):
    """float64 tensors are "on the device"; a copy runs when an event after it is waited for."""

    def __init__(self, free: int = 1 << 40, pin_error: str | None = None) -> None:
        super().__init__()
        self.free, self.pin_error = free, pin_error
        self.log: list[str] = []
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []

    def serves(self, tensor):
        return tensor.dtype == torch.float64

    def pin(self, shape, dtype):
        self.log.append("pin")
        if self.pin_error is not None:
            raise RuntimeError(self.pin_error)
        return torch.empty(shape, dtype=dtype)

    def free_bytes(self, device):
        return self.free

    def stream(self, device):
        return ("side", device)

    def after_current(self, stream):
        self.log.append("after_current")

    def copy(self, stream, target, source):
        self.log.append("copy")
        self.queued.append((target, source))

    def done(self, stream, hold):
        self.log.append(f"done(hold={hold})")
        return FakeEvent(self, hold)

    def run_queued(self):
        for target, source in self.queued:
            target.copy_(source)
        self.queued.clear()


def _state(scale: float = 1.0) -> dict:
    """Two "device" tensors (float64), one CPU tensor (float32), a plain value."""
    return {
        "w": torch.arange(6, dtype=torch.float64).reshape(2, 3) * scale,
        "opt": {"m": torch.full((4,), 2.0 * scale, dtype=torch.float64)},
        "cpu": torch.ones(3) * scale,
        "step": 7,
    }


DEVICE_BYTES = 6 * 8 + 4 * 8
DEVICE_PATHS = {("w",), ("opt", "m")}


def _equal(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["w"], b["w"]) and torch.equal(a["opt"]["m"], b["opt"]["m"])
        and torch.equal(a["cpu"], b["cpu"]) and a["step"] == b["step"]
    )  # fmt: skip


def test_the_first_save_copies_on_the_device_and_page_locks_its_buffers_in_the_background():
    """No page-locking in the call: the writer's ``take`` allocates the buffers and lands the copies."""
    device = FakeDevice()
    staging = Staging(device)
    state = _state()
    snapshot = stage(state, staging)
    assert dict(snapshot.routes) == {"device": DEVICE_BYTES, "cpu": 3 * 4}
    assert device.log == ["after_current", "copy", "copy", "done(hold=True)"]  # the current stream waits
    assert "pin" not in device.log and staging.pinned == set()
    assert snapshot.tree["w"] is not state["w"]
    taken = snapshot.take()
    assert device.log[4] == "synchronize"  # the writer waits for the call's copies before it reads them
    assert device.log.count("pin") == 2 and staging.pinned == DEVICE_PATHS
    assert _equal(taken, _state())
    assert taken["w"] is staging.buffers[("w",)] and taken["opt"]["m"] is staging.buffers[("opt", "m")]
    assert snapshot.tree is None  # the device copies are let go


def test_the_writer_thread_makes_the_copies_device_current_before_any_device_call():
    """A thread starts on GPU 0: its first CUDA call there would open a context on GPU 0 in every rank."""

    class Recording(FakeDevice):
        def current(self, device):
            self.log.append(f"current({device})")
            return super().current(device)

    device = Recording()
    snapshot = stage(_state(), Staging(device))
    assert snapshot.device == torch.device("cpu")  # where the fake's "device" tensors live
    start = len(device.log)
    snapshot.take()
    assert device.log[start] == "current(cpu)" and device.log[start + 1] == "synchronize"
    with device.current(torch.device("cpu")):  # not a CUDA device: nothing to switch
        pass


def test_a_first_save_the_device_allocator_cannot_take_copies_to_pageable_memory(monkeypatch):
    """Room by the free-memory count, but no block that large (fragmentation): pageable, not a failed save."""
    empty = torch.empty

    def fragmented(*args, **kwargs):
        if isinstance(kwargs.get("device"), torch.device):  # the device copy (buffers name "cpu")
            raise torch.OutOfMemoryError("no block that large")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", fragmented)
    staging = Staging(FakeDevice())
    snapshot = stage(_state(), staging)
    assert dict(snapshot.routes) == {"pageable": DEVICE_BYTES, "cpu": 3 * 4}
    monkeypatch.setattr(torch, "empty", empty)
    assert _equal(snapshot.take(), _state())
    assert staging.pinned == DEVICE_PATHS  # page-locked buffers for the next save


def test_a_second_save_copies_into_the_page_locked_buffers_of_the_first():
    device = FakeDevice()
    staging = Staging(device)
    stage(_state(), staging).take()
    kept = dict(staging.buffers)
    device.log.clear()
    snapshot = stage(_state(3.0), staging)
    assert dict(snapshot.routes) == {"page-locked": DEVICE_BYTES, "cpu": 3 * 4}
    assert snapshot.landing == {} and "pin" not in device.log
    taken = snapshot.take()
    assert _equal(taken, _state(3.0))
    assert all(staging.buffers[path] is kept[path] for path in kept)  # the same memory, not reallocated
    assert staging.pinned == DEVICE_PATHS


def test_without_room_on_the_device_the_first_save_copies_to_pageable_memory_and_pins_for_the_next():
    device = FakeDevice(free=DEVICE_BYTES)  # a device copy may take only half of it
    staging = Staging(device)
    snapshot = stage(_state(), staging)
    assert dict(snapshot.routes) == {"pageable": DEVICE_BYTES, "cpu": 3 * 4}
    assert "pin" not in device.log
    taken = snapshot.take()
    assert _equal(taken, _state())
    assert staging.pinned == DEVICE_PATHS  # allocated by the background thread, for the next save
    assert dict(stage(_state(), staging).routes) == {"page-locked": DEVICE_BYTES, "cpu": 3 * 4}


@pytest.mark.parametrize("free", [1 << 40, DEVICE_BYTES], ids=["device-room", "no-room"])
def test_failed_page_locking_falls_back_to_pageable_memory_with_one_warning_per_process(monkeypatch, free):
    """Not one per tensor, per save or per checkpointer; the saves stay exact and reuse their buffers."""
    monkeypatch.setattr(process, "_once", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two checkpointers (two Accelerators in one process)
            device = FakeDevice(free, pin_error="CUDA error: out of memory (cudaHostAlloc)")
            staging = Staging(device)
            kept = []
            for scale in (1.0, 2.0, 3.0):
                assert _equal(stage(_state(scale), staging).take(), _state(scale))
                kept.append(dict(staging.buffers))
            assert all(kept[2][path] is kept[1][path] for path in kept[1])
            assert device.log.count("pin") == 1  # tried once, then pageable for good
            assert not staging.pinning and staging.pinned == set()
            assert dict(stage(_state(), staging).routes) == {"pageable": DEVICE_BYTES, "cpu": 3 * 4}
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "Page-locking host memory" in messages[0] and "cudaHostAlloc" in messages[0]
    assert "pageable memory" in messages[0] and "ulimit -l" in messages[0]


def test_page_locking_that_fails_without_a_device_allocator_is_the_same_fallback(monkeypatch):
    """The real seam on this machine: torch without CUDA refuses ``pin_memory=True`` with a RuntimeError."""
    try:
        DeviceCopies().pin(torch.Size([2]), torch.float32)
        pytest.skip("page-locking works here")
    except RuntimeError:
        pass
    monkeypatch.setattr(process, "_once", set())
    device = FakeDevice()
    monkeypatch.setattr(device, "pin", DeviceCopies.pin.__get__(device))
    staging = Staging(device)
    with pytest.warns(RuntimeWarning, match="Page-locking host memory"):
        taken = stage(_state(), staging).take()
    assert _equal(taken, _state()) and staging.pinned == set() and not staging.pinning


def test_buffers_of_values_a_later_save_does_not_name_are_freed():
    staging = Staging(FakeDevice())
    stage({**_state(), "loss-1": torch.ones(5, dtype=torch.float64)}, staging).take()
    assert ("loss-1",) in staging.buffers and ("loss-1",) in staging.pinned
    stage(_state(), staging).take()
    assert ("loss-1",) not in staging.buffers and ("loss-1",) not in staging.pinned
    assert set(staging.buffers) == DEVICE_PATHS | {("cpu",)}


def test_a_buffer_of_another_shape_or_dtype_is_replaced():
    staging = Staging(FakeDevice())
    stage(_state(), staging).take()
    changed = {**_state(), "w": torch.zeros(3, 2, dtype=torch.float64)}
    snapshot = stage(changed, staging)
    assert snapshot.routes["device"] == 6 * 8 and snapshot.routes["page-locked"] == 4 * 8
    assert torch.equal(snapshot.take()["w"], torch.zeros(3, 2, dtype=torch.float64))


def test_cpu_tensors_are_copied_in_the_call_into_kept_pageable_buffers():
    """The real seam: no stream, no event, no page-locking for a CPU tensor; the copy is complete at the call."""
    staging = Staging()
    state = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.float64)}
    snapshot = stage(state, staging)
    assert snapshot.events == [] and dict(snapshot.routes) == {"cpu": 4 * 4 + 2 * 8}
    state["a"].mul_(0)  # after the call
    kept = snapshot.tree["a"]
    assert torch.equal(snapshot.take()["a"], torch.arange(4.0))
    assert not kept.is_pinned() and staging.pinned == set()
    assert stage(state, staging).take()["a"] is kept


def test_a_failure_during_the_copy_still_makes_the_current_stream_wait_for_the_copies_queued():
    class Unpicklable:
        def __deepcopy__(self, memo):
            raise TypeError("cannot copy")

    device = FakeDevice()
    with pytest.raises(TypeError, match="cannot copy"):
        stage({"w": torch.ones(2, dtype=torch.float64), "z": Unpicklable()}, Staging(device))
    assert device.log == ["after_current", "copy", "done(hold=True)"]


def test_the_handle_reports_what_each_route_copied(tmp_path):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model}, asynchronous=True)
    handle.wait()
    assert handle.staged.keys() == {"cpu"}  # the weights and the record's tensors (RNG states)
    assert handle.staged["cpu"] >= (16 + 4) * 4


def test_a_failure_while_the_background_thread_takes_the_copy_fails_the_save(tmp_path, monkeypatch):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = acc.setup(torch.nn.Linear(4, 4))

    def fails(self):
        raise MemoryError("page-locking exhausted host memory")

    monkeypatch.setattr(staging_module.Snapshot, "take", fails)
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model}, asynchronous=True)
    with pytest.raises(CheckpointError, match="page-locking exhausted host memory"):
        handle.wait()
    assert not (tmp_path / "ckpt.pt").exists()
    assert service.stage is staging_module.stage


def _on_a_device_mesh(local: torch.Tensor):
    """``local`` as the shard of a DTensor whose mesh is a CUDA mesh (as under FSDP on a GPU); no CUDA needed.

    ``DTensor.from_local`` would move ``local`` to the mesh's device type.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh("cuda", [0], _init_backend=False)
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), meta), requires_grad=False)


def test_a_dtensor_on_a_device_mesh_keeps_its_host_copy_on_the_host():
    """The copy of a DTensor's shard is the host buffer itself, from the first save on.

    Rebuilt with ``DTensor.from_local`` it went back to the mesh's device: at the first save the
    background thread held a second copy of the state on the GPU for the whole write, and from the
    second save on the call read the page-locked buffer back on the current stream before the side
    stream had written it (the previous save's values) and waited for the device.
    """
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()  # a process group, which a device mesh needs
    staging = Staging(FakeDevice())
    shard = torch.arange(4, dtype=torch.float64)
    for scale in (1.0, 2.0):
        state = {"w": _on_a_device_mesh(shard * scale), "cpu": torch.ones(2)}
        copy = stage(state, staging).take()["w"]
        assert copy.device_mesh.device_type == "cuda" and copy.placements == state["w"].placements
        assert copy.shape == state["w"].shape and copy.stride() == state["w"].stride()
        assert copy.to_local().data_ptr() == staging.buffers[("w",)].data_ptr()
        assert torch.equal(copy.to_local(), shard * scale)


def test_a_tensor_named_twice_is_copied_once_and_both_names_hold_that_copy():
    """Tied weights (an embedding and an output head): the synchronous save writes one tensor under
    both names, and loads them back sharing it; the copy was made twice (twice the bytes, and at the
    first save twice the room on the device) and the names came back apart."""
    staging = Staging(FakeDevice())
    for scale, route in ((1.0, "device"), (2.0, "page-locked")):
        state = _state(scale)
        state["tied"] = state["w"]
        state["shared"] = state["opt"]["m"]
        snapshot = stage(state, staging)
        assert dict(snapshot.routes) == {route: DEVICE_BYTES, "cpu": 3 * 4}
        taken = snapshot.take()
        assert taken["tied"] is taken["w"] is staging.buffers[("w",)]
        assert taken["shared"] is taken["opt"]["m"] is staging.buffers[("opt", "m")]
        assert _equal(taken, _state(scale))
    assert set(staging.buffers) == DEVICE_PATHS | {("cpu",)}


def test_without_room_and_without_page_locking_the_first_saves_copies_stay_the_kept_buffers(monkeypatch):
    """The background thread's page-locking failed for the first tensor: it allocated a pageable
    buffer of its own to keep, beside the one the call had just copied into."""
    monkeypatch.setattr(process, "_once", set())
    staging = Staging(FakeDevice(free=DEVICE_BYTES, pin_error="cudaHostAlloc refused"))
    with pytest.warns(RuntimeWarning, match="Page-locking host memory"):
        taken = stage(_state(), staging).take()
    assert taken["w"] is staging.buffers[("w",)] and taken["opt"]["m"] is staging.buffers[("opt", "m")]
