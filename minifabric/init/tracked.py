"""Which meta tensor stands for which recorded base, for the recorder (:mod:`~minifabric.init.record`).

A tracked tensor is bound to its :class:`~minifabric.init.recipe.Handle` on the recording (see
:mod:`~minifabric.init.attach`). A meta tensor made another way (``w.data``, ``w.detach()``, a view
rebuilt by torch) that views the same memory the same way gets the same handle. ``Tensor.set_`` and
``torch.utils.swap_tensors`` replace a tensor's data without reaching a ``TorchFunctionMode``:
:meth:`Tracked.lookup` notices it from the tensor's memory layout and follows the new data.
"""

from __future__ import annotations

from typing import Any

import torch

from minifabric._torch import storage_key
from minifabric.init.attach import Recording, handle_of
from minifabric.init.recipe import Base, Handle


class Tracked:
    """The tracked tensors of one recording, by storage and by memory layout.

    Args:
        recording: where tensors are bound to their handles.
        device: where eager construction builds a new base that has no real value (the build device).
    """

    def __init__(self, recording: Recording, device: torch.device) -> None:
        self.recording, self.device = recording, device
        self.alive: list[torch.Tensor] = []  # tracked meta tensors: their storages are never reused
        self.by_storage: dict[int, list[tuple[torch.Tensor, Handle]]] = {}
        # id of a tracked tensor (kept alive by `alive`) -> its memory layout when tracked, and
        # layout -> handle (see `lookup`)
        self._layouts: dict[int, tuple] = {}
        self._by_layout: dict[tuple, Handle] = {}

    def track(self, t: torch.Tensor, handle: Handle | Base, device: torch.device | None = None) -> Handle:
        """Remember ``t`` as a view (or the whole) of a recorded base (a new one: eager construction has
        it on ``device``; by default where its real value is, else on the build device)."""
        if isinstance(handle, Base):
            handle.device = device or (handle.value.device if handle.value is not None else self.device)
            if handle.stride is None:  # random init fills memory in stride order: part of the record
                handle.stride = tuple(t.stride())
            handle = Handle(handle)
        self.recording.bind(t, handle)
        self.alive.append(t)
        self.by_storage.setdefault(storage_key(t), []).append((t, handle))
        if t.is_meta:
            self._layouts[id(t)] = _layout(t)
            self._by_layout[_layout(t)] = handle
        return handle

    def lookup(self, t: Any) -> Handle | None:
        """The handle of ``t``: its own, or that of a tracked tensor viewing the same memory the same way."""
        handle = handle_of(t)
        if handle is not None and t.is_meta and self._layouts.get(id(t), _layout(t)) != _layout(t):
            return self._data_replaced(t)
        if handle is not None or not isinstance(t, torch.Tensor) or not t.is_meta:
            return handle
        for known, known_handle in self.by_storage.get(storage_key(t), ()):
            if (known.shape, known.stride(), known.storage_offset()) == (t.shape, t.stride(), t.storage_offset()):
                self.recording.bind(t, known_handle)
                self.alive.append(t)
                self._layouts[id(t)] = _layout(t)
                return known_handle
        return None

    def relaid(self, t: torch.Tensor) -> None:
        """``t``'s data was replaced where the recorder saw it (``.data =`` its own base): its new layout."""
        self._layouts[id(t)] = _layout(t)

    def _data_replaced(self, t: torch.Tensor) -> Handle:
        """``t``'s data was replaced unseen (``Tensor.set_``, ``torch.utils.swap_tensors``): follow it.

        Its new data is that of a tracked tensor (``original.set_(new)`` in
        ``register_parametrization``, a swap of two tracked tensors): ``t`` now shares that record,
        as it shares that memory. Otherwise its value is unknown: marked, and refused at ``setup``.
        """
        handle = self._by_layout.get(_layout(t))
        if handle is None:
            base = Base(t.shape, t.dtype, "computed")
            base.problem = (
                "had its data replaced by a call that torch does not let minifabric record"
                " (`Tensor.set_` or `torch.utils.swap_tensors` with a tensor of unknown value)"
            )
            handle = Handle(base)
        return self.track(t, handle)

    def settle(self) -> None:
        """At the end of the recording: bring every tracked tensor's record up to date (see ``lookup``)."""
        for t in self.alive:
            if t.is_meta:
                self.lookup(t)


def _layout(t: torch.Tensor) -> tuple:
    return (storage_key(t), t.shape, t.stride(), t.storage_offset())
