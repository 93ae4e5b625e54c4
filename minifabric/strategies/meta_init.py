"""Meta-device construction and materialization: plain functions that every strategy uses.

Inside :func:`meta_init_context` every parameter is created on the meta device (no memory) and
every init the model's ``__init__`` applies to it (``self.apply(_init_weights)``, ``nn.init.*``,
``w.data.normal_()``, ``reset_parameters()``) is recorded with the random-generator state it ran
with (:mod:`~minifabric.strategies.init_record`, :mod:`~minifabric.strategies.init_replay`). Buffers computed in ``__init__`` are created for
real, as in eager construction. At ``setup`` each parameter's recorded init is replayed at full
size on the CPU, so its value is bitwise the one eager construction with the same seed gives; the
FSDP strategy then keeps only each rank's slice (:mod:`~minifabric.strategies.fsdp_init`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from minifabric._torch import module_registration_hooks
from minifabric.strategies.init_record import InitRecorder
from minifabric.strategies.init_replay import HANDLE_ATTR, Base, Handle, evaluate, handle_of, set_handle

#: (module, attribute name, is a parameter, recorded init) for every meta tensor of a model.
Place = tuple[nn.Module, str, bool, Base]

_PLACES_ATTR = "_minifabric_init_places"
_RECORDER: ContextVar[InitRecorder | None] = ContextVar("minifabric_init_recorder", default=None)


@contextmanager
def meta_init_context() -> Iterator[None]:
    """Create parameters on the meta device and record how ``__init__`` initializes them."""
    recorder = InitRecorder()

    def on_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
        with recorder.paused_recording():
            if recorder.lookup(param) is None and not param.is_meta:
                # Created for real (torch.ones, torch.randn, ...): keep that value, hold no storage.
                meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
                recorder.track(meta, Base(param.shape, param.dtype, "value", value=param.detach()))
                param = meta
            _remember(module, name, handle_of(param))
        return param

    def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor:
        with recorder.paused_recording():
            _remember(module, name, recorder.lookup(buffer))
        return buffer

    token = _RECORDER.set(recorder)
    try:
        with module_registration_hooks(on_parameter, on_buffer), recorder:
            yield
    finally:
        _RECORDER.reset(token)


def _remember(module: nn.Module, name: str, handle: Handle | None) -> None:
    # Also kept by place, for when torch's `fully_shard` replaces the parameter before `setup`.
    places = module.__dict__.setdefault(_PLACES_ATTR, {})
    if handle is None:
        places.pop(name, None)
    else:
        places[name] = handle


def _handle_at(sub: nn.Module, name: str, t: torch.Tensor) -> Handle | None:
    handle = handle_of(t)
    if handle is None:
        handle = sub.__dict__.get(_PLACES_ATTR, {}).get(name)
        if handle is not None and handle.base.shape != t.shape:
            return None
    return handle


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
        (sub, name, handle)
        for sub in module.modules()
        for name, p in sub._parameters.items()
        if (handle := handle_of(p)) is not None
    ]
    with paused_recording():
        yield
    for sub, name, handle in saved:
        new = sub._parameters[name]
        if new is not None and handle_of(new) is None:
            set_handle(new, handle)


def has_meta_parameters(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` still lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_places(module: nn.Module) -> list[Place]:
    """Every meta parameter and buffer of ``module`` with its recorded init.

    Raises:
        ValueError: a meta tensor whose init cannot be reproduced (named, with the fix), before
            anything is changed: call it on every rank before any collective.
    """
    places: list[Place] = []
    root = type(module).__name__
    for prefix, sub in module.named_modules():
        for is_param, tensors in ((True, sub._parameters), (False, sub._buffers)):
            for name, t in tensors.items():
                if t is None or not t.is_meta:
                    continue
                label = f"{'parameter' if is_param else 'buffer'} {f'{prefix}.{name}' if prefix else name!r}"
                where = f"{label} of {root} (in {type(sub).__name__})"
                handle = _handle_at(sub, name, t)
                if handle is None or handle.chain:
                    raise ValueError(
                        f"The {where} is on the meta device but was not created inside"
                        " `acc.init_module(empty_init=True)`, so its init is unknown. Build the whole model"
                        " inside it: `with acc.init_module(empty_init=True): model = Model()`."
                    )
                if handle.base.problem is not None:
                    raise ValueError(
                        f"The init of the {where} cannot be reproduced after `init_module(empty_init=True)`:"
                        f" {handle.base.problem}. Initialize it with `torch.nn.init` functions or in-place ops"
                        " on the parameter (e.g. `torch.nn.init.normal_(self.weight, std=0.02)`), or build this"
                        " model with `acc.init_module(empty_init=False)`."
                    )
                if is_param and not handle.base.written:
                    raise ValueError(
                        f"The {where} is created with `torch.empty` and never initialized in `__init__`: eager"
                        " construction leaves it as uninitialized memory, so there is no value to reproduce."
                        f" Initialize it in `{type(sub).__name__}.__init__`, e.g."
                        f" `torch.nn.init.normal_(self.{name}, std=0.02)`, or call `self.reset_parameters()`"
                        " (or the root's `self.init_weights()`) at the end of `__init__`."
                    )
                places.append((sub, name, is_param, handle.base))
    return places


def forget_init_records(module: nn.Module) -> None:
    """Drop the recorded init from ``module``'s tensors (after materialization)."""
    for t in (*module.parameters(), *module.buffers()):
        if HANDLE_ATTR in t.__dict__:
            delattr(t, HANDLE_ATTR)
    for sub in module.modules():
        sub.__dict__.pop(_PLACES_ATTR, None)


def tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) places that share one parameter object."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    return [group for group in places.values() if len(group) > 1]


def materialize(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter and buffer with its eager-construction value on ``device``.

    A parameter shared by several modules (tied weights) stays one parameter.
    """
    places = init_places(module)
    replaced: dict[int, torch.Tensor] = {}
    for sub, name, is_param, base in places:
        tensors = sub._parameters if is_param else sub._buffers
        old: Any = tensors[name]
        if id(old) not in replaced:
            value = evaluate(base).to(device=device, dtype=old.dtype)
            replaced[id(old)] = type(old)(value, requires_grad=old.requires_grad) if is_param else value
        tensors[name] = replaced[id(old)]  # type: ignore[assignment]
    forget_init_records(module)
