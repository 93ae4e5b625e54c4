"""Meta-device construction and materialization: plain functions that every strategy uses.

Inside :func:`meta_init_context` every *parameter* is created on the meta device (no memory, no
init cost) while buffers are created for real, so values computed in ``__init__`` (causal masks,
rotary tables) are never lost. At ``setup`` the strategy calls :func:`materialize` (or the FSDP
variant, which keeps only each rank's shard): parameters get real storage and are initialized with
each module's ``reset_parameters()``, or with the root's ``init_weights()`` when it defines one.
The RNG state at the start of the context is replayed, so a seeded model gets the same weights as
eager construction would have given it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_INIT_RNG_ATTR = "_minifabric_init_rng"


@contextmanager
def meta_init_context(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Create parameters on the meta device (in ``dtype`` when given); buffers stay real."""
    rng_state = torch.get_rng_state()
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            target = dtype if dtype is not None and param.is_floating_point() else param.dtype
            param = type(param)(param.to(device="meta", dtype=target), requires_grad=param.requires_grad)
        original(module, name, param)
        if param is not None and not hasattr(module, _INIT_RNG_ATTR):
            setattr(module, _INIT_RNG_ATTR, rng_state)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_parameters(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` still lives on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_rng_state(module: nn.Module) -> torch.Tensor | None:
    """The CPU RNG state recorded when ``module``'s first meta parameter was created."""
    for sub in module.modules():
        state = getattr(sub, _INIT_RNG_ATTR, None)
        if state is not None:
            return state
    return None


def check_initializable(module: nn.Module) -> None:
    """Raise if some submodule with meta parameters could not be initialized after materialization."""
    if callable(getattr(module, "init_weights", None)):
        return
    for name, sub in module.named_modules():
        own = [t for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False)) if t.is_meta]
        if own and not callable(getattr(sub, "reset_parameters", None)):
            label = name or type(module).__name__
            raise TypeError(
                f"Module {label!r} ({type(sub).__name__}) was built with `init_module(empty_init=True)`"
                " but defines neither `reset_parameters()` nor does the root model define `init_weights()`,"
                " so its parameters cannot be initialized after materialization. Add"
                f" `def reset_parameters(self): ...` to {type(sub).__name__}, define `init_weights()` on"
                " the root model, or build it with `init_module(empty_init=False)`."
            )


def initialize_weights(module: nn.Module, rng_state: torch.Tensor | None) -> None:
    """Initialize a materialized module in registration order, replaying the init-time RNG state.

    Uses the root's ``init_weights()`` when present, else every submodule's ``reset_parameters()``.
    A parameter shared by several modules (tied weights) keeps the values of the first module that
    initialized it, as in eager construction followed by tying; the RNG draws of the later modules
    still happen, so the rest of the stream matches eager construction too.
    The global RNG stream is left as it was before the call.
    """
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        init_weights = getattr(module, "init_weights", None)
        if callable(init_weights):
            init_weights()
        else:
            done: set[int] = set()
            for sub in module.modules():
                own = list(sub.parameters(recurse=False))
                reset_parameters = getattr(sub, "reset_parameters", None)
                if not own or not callable(reset_parameters):
                    continue
                keep = [(p, p.detach().clone()) for p in own if id(p) in done]
                reset_parameters()
                for p, value in keep:
                    p.copy_(value)
                done.update(id(p) for p in own)
    for sub in module.modules():
        if hasattr(sub, _INIT_RNG_ATTR):
            delattr(sub, _INIT_RNG_ATTR)


def tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) places that share one parameter object."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    return [group for group in places.values() if len(group) > 1]


def empty_meta_tensors(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on ``device``, in place.

    Unlike ``module.to_empty()``, tensors that are already real keep their values (a causal mask
    computed in ``__init__``), and a parameter shared by several modules stays one parameter.
    """
    replaced: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                empty = torch.empty_like(param, device=device)
                replaced[id(param)] = type(param)(empty, requires_grad=param.requires_grad)
            sub._parameters[name] = replaced[id(param)]
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device=device)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give meta parameters real storage on ``device`` and initialize them; tied weights stay tied."""
    if not has_meta_parameters(module):
        return
    check_initializable(module)
    rng_state = init_rng_state(module)
    empty_meta_tensors(module, device)
    initialize_weights(module, rng_state)
