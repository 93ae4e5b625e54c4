"""Where a recording lives: on the model it was made for, not in a process-wide registry.

One outermost ``init_module(empty_init=True)`` block makes one :class:`Recording`: which tracked
tensor has which :class:`~minifabric.init.recipe.Handle`, and each one's version counter when the
block ended. It is held by what the block built, and by nothing else:

- every tracked tensor refers to its recording (a private attribute on the tensor); the recording
  keys its tensors weakly, by identity (a tensor's ``==`` is elementwise), so it holds none alive;
- every module that registered a tracked tensor holds a :class:`ModuleRecord` (attribute name ->
  handle, in its ``__dict__``), for when torch's ``fully_shard`` or ``copy.deepcopy`` replaces the
  tensor objects before ``setup``.

So the record reaches ``setup`` with the model, and dies with it: a model deleted before ``setup``
takes its recording with it. A model that holds parts built in several blocks (a submodule reused
from another model) finds each part's recording through that part. ``setup`` reads it
(:func:`~minifabric.init.places.recorded_places`) and drops it (:func:`forget_records`) once the
tensors have their values.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from minifabric._torch import storage_key, tensor_version
from minifabric.init.recipe import Handle

_TENSOR_ATTR = "_minifabric_recording"
_MODULE_RECORD_ATTR = "_minifabric_init_record"
_UNBOUND_ATTR = "_minifabric_unbound_version"


class Recording:
    """What one outermost ``init_module(empty_init=True)`` block recorded (see the module docstring).

    Several models built in one block share it (their recipes may read each other's tensors).
    """

    def __init__(self) -> None:
        #: tracked tensor -> its handle (weak keys, by identity)
        self.handles: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: tracked tensor -> its version counter when the block ended: a write after that (not
        #: recorded, so lost at ``setup``) changes the counter and is refused at ``setup``.
        self.sealed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        #: modules given a record inside the block (their ``reset_parameters`` is noted at the end)
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __deepcopy__(self, memo: dict) -> Recording:
        # `copy.deepcopy` of a plain tensor copies its `__dict__`: the copy refers to the same
        # recording, which does not know the copy (it is found by its module's record, by name).
        return self

    def __reduce__(self) -> tuple[type, tuple]:
        # A pickled tensor (`torch.save(param)`) is another object where it is loaded: it has no
        # record. Saved as an empty `set`, one of the few types `torch.load(weights_only=True)`
        # accepts, so what is saved loads with torch's default and without minifabric.
        return (set, ())

    def bind(self, t: torch.Tensor, handle: Handle) -> None:
        """Record that ``t`` has ``handle`` (``t`` then refers to this recording)."""
        old = recording_of(t)
        if old is not None and old is not self:  # a tensor of an earlier block, bound anew here
            old.handles.pop(t, None)
            sealed = old.sealed.pop(t, None)
            if sealed is not None:
                self.sealed[t] = sealed
        self.handles[t] = handle
        t.__dict__[_TENSOR_ATTR] = self

    def seal(self) -> None:
        """Note each tensor's version counter and each module's own ``reset_parameters`` (the block ended).

        A tensor sealed before keeps its first count (a write between two blocks is lost too).
        Lightning Fabric calls a ``reset_parameters`` set after the block when FSDP materializes the
        model; ``setup`` here never does, and refuses one.
        """
        for t in list(self.handles.keys()):
            if t not in self.sealed:
                self.sealed[t] = tensor_version(t)
        for module in list(self.modules):
            record = module_record(module)
            if record is not None and record.own_reset is None:
                record.own_reset = "reset_parameters" in module.__dict__
        self.modules.clear()


class ModuleRecord(dict):
    """Attribute name -> handle of the meta tensors a module registered inside ``init_module``.

    Kept in the module's ``__dict__``: a registry with weak keys would lose it when
    ``copy.deepcopy`` (``AveragedModel``, an EMA copy) copies the module, and the copy must set up
    to the same weights as the original. A copy shares the record (the recipes are the original's),
    so ``deepcopy`` returns it unchanged.
    """

    #: Whether the module had its own ``reset_parameters`` (an instance attribute) when its
    #: ``init_module`` ended; None until then. One set later is refused at ``setup``.
    own_reset: bool | None = None

    def __deepcopy__(self, memo: dict) -> ModuleRecord:
        return self


def recording_of(t: Any) -> Recording | None:
    """The recording a tracked tensor refers to, if any (a loaded copy of one refers to none)."""
    recording = t.__dict__.get(_TENSOR_ATTR) if isinstance(t, torch.Tensor) else None
    return recording if isinstance(recording, Recording) else None


def handle_of(t: Any) -> Handle | None:
    """The handle recorded for a tracked tensor, if any."""
    recording = recording_of(t)
    return recording.handles.get(t) if recording is not None else None


def sealed_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter when its ``init_module`` block ended (None if not sealed)."""
    recording = recording_of(t)
    return recording.sealed.get(t) if recording is not None else None


def unbind(t: torch.Tensor) -> None:
    """Forget ``t``'s handle (its data was replaced by another value).

    A meta tensor keeps a note of its version counter now (no weak reference): another model that
    still holds it finds its record by name, and :func:`written_unseen` tells a write since.
    """
    recording = recording_of(t)
    if recording is not None:
        recording.handles.pop(t, None)
        recording.sealed.pop(t, None)
        del t.__dict__[_TENSOR_ATTR]
        if t.is_meta:
            t.__dict__[_UNBOUND_ATTR] = (storage_key(t), tensor_version(t))


def written_unseen(t: torch.Tensor) -> bool:
    """Whether ``t``, which has no handle (known by name only), was written since it was made or unbound.

    A copy made after the block (``copy.deepcopy``) starts at version 0; a tensor unbound when
    another model was materialized, at the version noted then (a plain tensor's copy carries the
    note but not the storage it was made for).
    """
    storage, version = t.__dict__.get(_UNBOUND_ATTR, (None, 0))
    return tensor_version(t) != (version if storage == storage_key(t) else 0)


def module_record(module: nn.Module, create: bool = False) -> ModuleRecord | None:
    """The record of ``module``'s meta tensors (created empty when ``create``)."""
    record = module.__dict__.get(_MODULE_RECORD_ATTR)
    if record is None and create:
        record = module.__dict__[_MODULE_RECORD_ATTR] = ModuleRecord()
    return record


def has_init_records(module: nn.Module) -> bool:
    """Whether ``module`` was built (in part) inside ``init_module(empty_init=True)``."""
    return any(module_record(sub) for sub in module.modules()) or any(
        handle_of(t) is not None for t in (*module.parameters(), *module.buffers())
    )


def forget_records(module: nn.Module) -> None:
    """Drop what was recorded for ``module``'s tensors (after they were materialized)."""
    for t in (*module.parameters(), *module.buffers()):
        unbind(t)
    for sub in module.modules():
        sub.__dict__.pop(_MODULE_RECORD_ATTR, None)
