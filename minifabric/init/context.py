"""The ``init_module(empty_init=True)`` context: parameters are born on the meta device, init is recorded.

Inside :func:`meta_init_context` every floating-point parameter is created on the meta device (no
memory) and every init the model's ``__init__`` applies to it (``self.apply(_init_weights)``,
``nn.init.*``, ``w.data.normal_()``, ``reset_parameters()``) is recorded by a
:class:`~minifabric.init.record.Recorder`. Buffers computed in ``__init__`` are created for real, as
in eager construction. :func:`~minifabric.init.materialize.materialize` turns the records into
values at ``setup``. When the context ends, each tracked tensor's version counter is noted: an
in-place write after that (``nn.init.normal_(model.weight)`` between the block and ``setup``) is
not recorded, and ``setup`` refuses it instead of silently replaying the constructor's init.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from torch import nn

from minifabric._torch import inside_distribute_module, module_registration_hooks, storage_key, tensor_version
from minifabric.init.attach import Recording, handle_of, module_record, recording_of
from minifabric.init.recipe import Base, Handle, is_dtensor
from minifabric.init.record import Recorder
from minifabric.init.verify import noting_constructions, rebuilding_eagerly

if TYPE_CHECKING:
    from minifabric.init.places import Place

# The recorder of the block being executed. A scope that truly needs it: a nested `init_module`
# records into the outer block's recording, and `wrap` (called from model code inside the block,
# which is not handed the context) pauses it around `fully_shard`. Nothing recorded travels
# through it: the recording is held by the models built (`minifabric.init.attach`).
_RECORDER: ContextVar[Recorder | None] = ContextVar("minifabric_init_recorder", default=None)


@contextmanager
def meta_init_context(
    verify: bool = False,
    keep: tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
    keep_on: torch.device | str | None = None,
) -> Iterator[None]:
    """Create parameters on the meta device and record how ``__init__`` initializes them.

    Args:
        verify: also note how each model is constructed, so ``setup`` can build it again eagerly
            and compare (:mod:`~minifabric.init.verify`).
        keep: ``(parts, index)``: keep chunk ``index`` of ``parts`` along dim 0 of each value a first
            (random) write computes at construction, the part of it this rank will hold after
            ``setup`` (``(1, 0)``: all of it), so ``setup`` copies it instead of running the init a
            second time. None keeps nothing (``setup`` replays every init).
        device: the build device: where ``init_module(empty_init=False)`` would construct the model
            (the block runs in its default-device context). Random inits draw from its generator,
            as eager construction there does, and ``setup`` computes the values there
            (:mod:`~minifabric.init.generators`).
        keep_on: where the kept parts wait for ``setup``: where the parameters will live (the CPU
            when FSDP offloads them, so that a GPU holds no part of the model before ``setup``);
            default ``device``.

    Example:
        >>> import torch
        >>> from minifabric.init import meta_init_context, materialize
        >>> with meta_init_context():
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.is_meta
        True
        >>> materialize(layer)
        >>> layer.weight.is_meta
        False
    """
    if rebuilding_eagerly():  # the self-check's eager rebuild of a model that enters this block itself
        yield
        return
    if _RECORDER.get() is not None:  # nested: the outer context records everything, once
        with noting_constructions(device) if verify else nullcontext():
            yield
        return
    recorder = Recorder(keep, device, keep_on)

    def on_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
        with recorder.paused_recording():
            recorder.check_parameter(module, name, param)
            if recorder.tracked.lookup(param) is None and not param.is_meta:
                # Created for real (torch.ones, torch.randn, ...): keep that value, hold no storage.
                meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
                recorder.tracked.track(meta, Base(param.shape, param.dtype, "value", value=param.detach()))
                param = meta
            _remember(recorder.recording, module, name, recorder.tracked.lookup(param))
        return param

    def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor:
        with recorder.paused_recording():
            _remember(recorder.recording, module, name, recorder.tracked.lookup(buffer))
        return buffer

    token = _RECORDER.set(recorder)
    try:
        with module_registration_hooks(on_parameter, on_buffer), torch.device(device), recorder:
            with noting_constructions(device) if verify else nullcontext():
                yield
        recorder.tracked.settle()
    finally:
        recorder.draws.release()
        _RECORDER.reset(token)
        # what is written from now on is not recorded: `setup` refuses it (the outermost context)
        recorder.recording.seal()


def _remember(recording: Recording, module: nn.Module, name: str, handle: Handle | None) -> None:
    # Also kept by place, for when `fully_shard` or `copy.deepcopy` replaces the tensor before `setup`.
    record = module_record(module, create=handle is not None)
    if record is None:
        return
    recording.modules.add(module)
    if handle is None:
        record.pop(name, None)
    else:
        record[name] = handle


def paused_recording() -> ContextManager:
    """Inside, torch calls are not recorded (e.g. ``fully_shard`` run by ``wrap`` in ``init_module``)."""
    recorder = _RECORDER.get()
    return recorder.paused_recording() if recorder is not None else nullcontext()


@contextmanager
def keeping_init_records(module: nn.Module) -> Iterator[None]:
    """Around a call that replaces ``module``'s parameters (``fully_shard``): the new ones keep their init.

    Init applied to the new parameters afterwards (still inside ``init_module``) is recorded too.
    """
    saved = [
        (sub, name, handle, recording_of(p))
        for sub in module.modules()
        for name, p in sub._parameters.items()
        if (handle := handle_of(p)) is not None
    ]
    with paused_recording():
        yield
    recorder = _RECORDER.get()
    for sub, name, handle, recording in saved:
        new = sub._parameters[name]
        if new is not None and handle_of(new) is None:
            (recorder.recording if recorder is not None else recording).bind(new, handle)


@contextmanager
def following_init_records(places: list[Place], root: nn.Module | None = None) -> Iterator[None]:
    """Inside, each recorded meta tensor carries its record into whatever module it is registered in.

    Around user code that rebuilds modules of a meta-built model before it is materialized (a
    ``parallelize_fn`` that swaps ``nn.Linear`` for a subclass built ``from_float``-style, which
    takes over the old module's ``Parameter`` objects, then applies a tensor-parallel plan). On
    entry every tensor of ``places`` (:func:`~minifabric.init.places.recorded_places`) is bound
    to its record by identity, so the record follows the tensor, not the module that held it, and
    ``setup`` materializes the modules now in the model. A meta tensor registered in place of a
    recorded one is that tensor laid out anew only if it is a DTensor of the same shape registered
    from inside torch's ``distribute_module`` (every ``parallelize_module`` style registers one per
    planned parameter there): it takes over the record. Any other meta tensor registered inside
    (also a DTensor made by hand, ``distribute_tensor(w * 0.5, ...)``, whose values may differ)
    has no record, and ``setup`` refuses it, naming it.

    An in-place write inside (``nn.init.zeros_(model.head.weight)``) does nothing on the meta device
    and is not recorded: one to a recorded tensor (also to a DTensor the plan registered) raises
    when the code returned, naming it. Writes through ``.data`` and to tensors that ``fully_shard``
    made are not seen. ``root``: the model, to name such a tensor.
    """
    prefixes = {id(sub): f"{prefix}." if prefix else "" for prefix, sub in (root.named_modules() if root else ())}

    def label(sub: nn.Module, name: str) -> str:
        prefix = prefixes.get(id(sub))  # None: a module built inside, named by its class
        return f"{type(sub).__name__}.{name}" if prefix is None else repr(f"{prefix}{name}")

    watched: list[tuple[str, torch.Tensor, tuple]] = []  # (name, tensor, its state when bound)
    for sub, name, is_param, handle in places:
        tensor = (sub._parameters if is_param else sub._buffers)[name]
        if tensor is not None and handle_of(tensor) is None:
            Recording().bind(tensor, handle)  # a copy's tensor, known by name only: now by identity
        if tensor is not None:
            watched.append((label(sub, name), tensor, _state(tensor)))

    def follow(module: nn.Module, name: str, tensor: torch.Tensor, table: dict) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor
        handle = handle_of(tensor)
        old = table.get(name)
        if (
            handle is None
            and is_dtensor(tensor)
            and old is not None
            and old.shape == tensor.shape
            and inside_distribute_module()
        ):
            handle = handle_of(old)  # `parallelize_module`: the same parameter, laid out over the mesh
            if handle is not None:
                recording_of(old).bind(tensor, handle)  # type: ignore[union-attr]
        if handle is not None:
            watched.append((label(module, name), tensor, _state(tensor)))
        record = module_record(module, create=handle is not None)
        if record is not None:
            if handle is None:
                record.pop(name, None)
            else:
                record[name] = handle
        return tensor

    with module_registration_hooks(
        lambda module, name, param: follow(module, name, param, module._parameters),
        lambda module, name, buffer: follow(module, name, buffer, module._buffers),
    ):
        yield
    written = list(dict.fromkeys(name for name, t, state in watched if _changed(t, state)))
    if written:
        raise ValueError(
            f"{', '.join(written)} (meta-built, not yet materialized) was changed in place, or its `.data`"
            " replaced, by code that ran after `init_module(empty_init=True)` ended (a `parallelize_fn`): on"
            " the meta device that does nothing and is not recorded, so `setup` cannot reproduce it. A"
            " dtype conversion (`model.to(torch.bfloat16)`) is fine. Move the init into the"
            " block, right after constructing the model: `with acc.init_module(empty_init=True): model ="
            " Model(); init_weights(model)`; or build it with `acc.init_module(empty_init=False)`."
        )


def _state(t: torch.Tensor) -> tuple:
    return tensor_version(t), storage_key(t), t.dtype, t.shape, t.stride()


def _changed(t: torch.Tensor, state: tuple) -> bool:
    """Written in place since ``state``, or given other ``.data`` (a new dtype alone, as ``.to``, is not a change)."""
    version, key, dtype, shape, stride = state
    if tensor_version(t) != version:
        return True
    return storage_key(t) != key and (t.dtype == dtype or t.shape != shape or t.stride() != stride)
