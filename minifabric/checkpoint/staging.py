"""The copy an asynchronous save takes before it returns: which memory each tensor goes into, on which stream.

The invariant: the copy is exactly the state at the call; nothing done after the call reaches it.

- A CPU tensor is copied in the call, into a CPU buffer kept for the next save (a memcpy).
- A CUDA tensor is copied on a side stream of its device (one per device, kept). The side stream
  first waits for the work queued so far on the current stream, so the copy reads the state at
  the call. Before the call returns, the current stream waits for the side stream, on the device
  (no host synchronization): every kernel queued afterwards (``optimizer.step()``, an in-place
  write) runs after the copy, and the call does not wait for it. ``record_stream`` keeps torch's
  caching allocator from giving a tensor's memory to another tensor while the side stream still
  reads it. The background writer waits for the copy (an event, on its own thread) before it
  reads the copy.

Where a CUDA tensor is copied to (``Snapshot.routes`` counts the bytes of each route):

- ``"page-locked"``: its page-locked buffer, kept from the previous save. The device-to-host copy
  runs at the bus's speed (54.6 GB/s on an H200, 12.5 GB/s into pageable memory) and the host does
  not wait for it.
- ``"device"``: it has no such buffer yet (the first save) and the device has room (the copies of
  the first save take at most ``DEVICE_SHARE`` of the memory free outside torch's allocator): a
  copy on the device, which takes milliseconds. The background thread allocates the page-locked
  buffers (page-locking GBs takes seconds), copies the device copy into them and frees it. The
  first save thus does not stall either; it holds a second copy of the state on the device until
  its buffers are allocated.
- ``"pageable"``: no buffer yet and no room on the device, or page-locking failed: a copy into
  pageable memory, which the call waits for (with the device's queued work). Where page-locking
  has not failed, the background thread allocates the page-locked buffers for the next save.

Page-locking fails where the host's limit on locked memory is reached: this checkpointer's buffers
are then pageable from then on, with one warning per process.
"""

from __future__ import annotations

import copy as copy_module
import logging
import warnings
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from minifabric import process
from minifabric._torch import with_local
from minifabric.checkpoint.tensors import map_tree

log = logging.getLogger(__name__)

#: the largest share of a device's free memory (outside torch's allocator) the first save's copies take
DEVICE_SHARE = 0.5

#: leaves that cannot change in place (every other leaf is copied by :func:`stage`)
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class DeviceCopies:
    """The CUDA calls of a staged copy, with one side stream per device (kept between saves).

    Tests replace it to run the staging policy on the CPU.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def serves(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is copied on a side stream (a CUDA tensor)."""
        return tensor.is_cuda

    def pin(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked CPU tensor; ``RuntimeError`` where the host refuses to lock more memory."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def free_bytes(self, device: torch.device) -> int:
        """Bytes free on ``device`` outside torch's caching allocator."""
        return torch.cuda.mem_get_info(device)[0]

    def stream(self, device: torch.device) -> Any:
        """``device``'s side stream (created at its first use)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def after_current(self, stream: Any) -> None:
        """Make ``stream`` wait for the work queued so far on its device's current stream (an event)."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))

    def copy(self, stream: Any, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queue the copy of ``source`` into ``target`` on ``stream``; their memory is not reused before it ran."""
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        for tensor in (source, target):
            if tensor.is_cuda:
                tensor.record_stream(stream)

    def current(self, device: torch.device | None) -> Any:
        """Inside, ``device`` is the calling thread's current CUDA device (a CPU or no device: no change).

        The background thread runs its CUDA calls (waiting for an event, page-locking, copying)
        under it: a thread's current device starts as GPU 0, and a CUDA call there would open a
        context on GPU 0 (hundreds of MB) in every rank's process.
        """
        return torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext()

    def done(self, stream: Any, hold: bool) -> Any:
        """An event that completes with the work queued on ``stream`` (``event.synchronize()`` waits for it).

        With ``hold``, the device's current stream waits for it too, on the device.
        """
        event = torch.cuda.Event(blocking=True)  # a thread waiting for it sleeps instead of spinning a core
        event.record(stream)
        if hold:
            torch.cuda.current_stream(stream.device).wait_event(event)
        return event


class Staging:
    """The CPU buffers of a checkpointer's asynchronous saves, kept from one save to the next.

    Holds each buffer under the path of the leaf it copies (the path itself, not a joined string,
    under which ``{"a/b": x}`` and ``{"a": {"b": y}}`` would share one buffer), which of them are
    page-locked, and whether page-locking has failed. Only one save uses them at a time (a save
    waits for the previous one's write).
    """

    def __init__(self, device: DeviceCopies | None = None) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.pinned: set[tuple] = set()
        self.pinning = True  # False once page-locking failed
        self.device = DeviceCopies() if device is None else device

    def fits(self, path: tuple, tensor: torch.Tensor, on_device: bool) -> bool:
        """Whether the buffer kept under ``path`` can take ``tensor``'s copy (page-locked for a device tensor)."""
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            return False
        return (path in self.pinned or not self.pinning) if on_device else path not in self.pinned

    def allocate(self, path: tuple, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        """A new buffer for ``like``, kept under ``path``: page-locked if asked and possible, else pageable."""
        buffer = None
        if pinned and self.pinning:
            try:
                buffer = self.device.pin(like.shape, like.dtype)
            except RuntimeError as err:
                self.pinning = False
                _warn_pinning_failed(err)
        self.pinned.discard(path)
        if buffer is None:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        else:
            self.pinned.add(path)
        self.buffers[path] = buffer
        return buffer

    def keep_only(self, paths: set[tuple]) -> None:
        """Free the buffers of paths not in ``paths`` (a value saved once must not hold its copy for the run)."""
        for path in self.buffers.keys() - paths:
            del self.buffers[path]
            self.pinned.discard(path)


def _warn_pinning_failed(err: RuntimeError) -> None:
    if process.once("checkpoint-pinning-failed"):
        warnings.warn(
            f"Page-locking host memory for the asynchronous save's buffers failed ({err}). The copies"
            " go into pageable memory instead: each asynchronous save now waits for its"
            " device-to-host copy, about 4x slower than into page-locked memory. Raise the host's"
            " limit on locked memory (`ulimit -l`, a container's memlock limit) to avoid it.",
            RuntimeWarning,
            stacklevel=2,
        )


@dataclass
class Snapshot:
    """The copy a save took: its tree, the copies still running on the devices, and what it copied where.

    ``routes`` maps each route (``"cpu"``, ``"page-locked"``, ``"device"``, ``"pageable"``, see the
    module docstring) to the bytes copied that way.
    """

    staging: Staging
    tree: Any = None
    routes: Counter = field(default_factory=Counter)
    events: list[Any] = field(default_factory=list)
    device: torch.device | None = None  # the device of the copies (one per rank), for the background thread
    landing: dict[tuple, str] = field(default_factory=dict)  # path -> "device" or "pageable"

    def take(self) -> Any:
        """The copy, complete (on the background thread); the snapshot lets go of it.

        Waits for the device's copies; moves the device-side copies into host buffers, and
        allocates the page-locked buffers the next save copies into (kept by the staging).
        """
        with self.staging.device.current(self.device):
            return self._take()

    def _take(self) -> Any:
        for event in self.events:
            event.synchronize()
        tree, self.tree = self.tree, None
        if self.landing:
            landed: dict[int, Any] = {}  # a copy that two names hold lands once, for both

            def land(path: tuple, leaf: Any) -> Any:
                if id(leaf) not in landed:
                    landed[id(leaf)] = self._land(path, leaf)
                return landed[id(leaf)]

            tree = map_tree(tree, land)
        return tree

    def _land(self, path: tuple, leaf: Any) -> Any:
        route = self.landing.get(path)
        if route is None:
            return leaf
        local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
        if route == "pageable":  # the call's copy is written; a page-locked buffer for the next save
            if self.staging.pinning:
                self.staging.allocate(path, local, pinned=True)
                if path not in self.staging.pinned:  # page-locking failed: the call's copy stays the buffer
                    self.staging.buffers[path] = local
            return leaf
        buffer = self.staging.allocate(path, local, pinned=True)
        device = self.staging.device
        stream = device.stream(local.device)
        device.copy(stream, buffer, local)
        device.done(stream, hold=False).synchronize()
        return with_local(buffer, leaf) if isinstance(leaf, DTensor) else buffer


def _plain(tensor: torch.Tensor) -> bool:
    """Whether a dense buffer holds ``tensor`` as it is (not sparse, quantized, nested or a subclass)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and not (
        tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested
    )


def _device_room(tree: Any, staging: Staging) -> dict[torch.device, bool]:
    """Per device: whether the copies of its tensors without a buffer fit in ``DEVICE_SHARE`` of its free memory."""
    needed: Counter = Counter()
    seen: set[int] = set()  # a tensor named twice is copied once

    def count(path: tuple, leaf: Any) -> Any:
        local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
        if isinstance(local, torch.Tensor) and _plain(local) and staging.device.serves(local):
            if id(leaf) not in seen and not staging.fits(path, local, on_device=True):
                needed[local.device] += local.nbytes
            seen.add(id(leaf))
        return leaf

    map_tree(tree, count)
    return {d: n <= DEVICE_SHARE * staging.device.free_bytes(d) for d, n in needed.items()}


def _device_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """Memory for ``tensor``'s copy on its device; None where the allocator cannot give it (fragmented).

    Allocated on the current stream, so that its memory goes back to training's pool when freed.
    """
    try:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    except torch.OutOfMemoryError:
        return None  # the copy goes to pageable memory instead


def stage(tree: Any, staging: Staging) -> Snapshot:
    """A copy of ``tree`` that nothing done to ``tree`` afterwards changes: tensors copied to CPU.

    DTensors keep their layout; containers are rebuilt, and any other mutable leaf (a set, a
    user's object) is deep-copied, so training may go on while the copy is written. The copies
    reuse the buffers of the previous save (kept by ``staging``): the copy is then a plain memcpy
    (or a device-to-host copy into page-locked memory), without allocating and faulting in fresh
    memory. Only this save's buffers are kept. CUDA tensors are copied on a side stream (module
    docstring); :meth:`Snapshot.take` gives the complete copy.
    """
    snapshot = Snapshot(staging)
    room = _device_room(tree, staging)
    streams: dict[torch.device, Any] = {}
    used: set[tuple] = set()

    def to_cpu(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        if not _plain(tensor):  # a dense buffer cannot hold it, or would hold it converted
            return tensor.detach().to("cpu", copy=True)
        device = staging.device
        if not device.serves(tensor):
            fits = staging.fits(path, tensor, on_device=False)
            buffer = staging.buffers[path] if fits else staging.allocate(path, tensor, pinned=False)
            snapshot.routes["cpu"] += tensor.nbytes
            return buffer.copy_(tensor.detach())
        if tensor.device not in streams:
            snapshot.device = snapshot.device or tensor.device
            streams[tensor.device] = device.stream(tensor.device)
            device.after_current(streams[tensor.device])
        fits = staging.fits(path, tensor, on_device=True)
        on_device = _device_copy(tensor) if not fits and room[tensor.device] else None
        target: torch.Tensor
        if fits:
            route, target = ("page-locked" if path in staging.pinned else "pageable"), staging.buffers[path]
        elif on_device is not None:
            route, target = "device", on_device
            snapshot.landing[path] = route
        else:
            route, target = "pageable", staging.allocate(path, tensor, pinned=False)
            if staging.pinning:  # the background thread page-locks a buffer for the next save
                snapshot.landing[path] = route
        device.copy(streams[tensor.device], target, tensor.detach())
        snapshot.routes[route] += tensor.nbytes
        return target

    # a tensor or object named twice (tied weights) is copied once and both names hold that copy,
    # as the synchronous save writes it once; the tree holds every leaf, so no id is reused meanwhile
    copies: dict[int, Any] = {}

    def copy(path: tuple, leaf: Any) -> Any:
        used.add(path)
        if isinstance(leaf, _IMMUTABLE):
            return leaf
        if id(leaf) not in copies:
            if isinstance(leaf, DTensor):  # not from_local: it moves the copy back to the mesh's device
                copies[id(leaf)] = with_local(to_cpu(path, leaf.to_local()), leaf)
            elif isinstance(leaf, torch.Tensor):
                copies[id(leaf)] = to_cpu(path, leaf)
            else:
                copies[id(leaf)] = copy_module.deepcopy(leaf, copies)  # the memo: shared parts stay shared
        return copies[id(leaf)]

    try:
        snapshot.tree = map_tree(tree, copy)
    finally:  # every kernel queued after the call runs after the copies queued so far
        snapshot.events = [staging.device.done(stream, hold=True) for stream in streams.values()]
    staging.keep_only(used)
    log.debug("asynchronous save: bytes copied by route %s", dict(snapshot.routes))
    return snapshot
