"""Materializing a sharded model that was built on the meta device: each rank keeps only its shard.

Random init cannot run on the shards directly: on CPU, torch's sharded RNG tracker is not used, so
every rank would fill its slice from the same random stream. Instead each parameter is
initialized at full size on the CPU, replaying the RNG state recorded by ``init_module`` exactly as
single-process init does (:func:`minifabric.strategies.meta_init.initialize_weights`), and each rank
copies out its own slice. With ``reset_parameters()`` only one module's parameters exist at full size
at a time; a root ``init_weights()`` initializes the whole model at once, so it needs the full model
in memory once, transiently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from minifabric.strategies.meta_init import initialize_weights

Place = tuple[nn.Module, str]


def real_buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every buffer that holds data (``init_module`` builds buffers for real; ``to_empty`` would wipe them)."""
    return [
        (sub, name, buf)
        for sub in module.modules()
        for name, buf in sub._buffers.items()
        if buf is not None and not buf.is_meta
    ]


def restore_buffers(saved: list[tuple[nn.Module, str, torch.Tensor]], device: torch.device) -> None:
    """Put buffers saved by :func:`real_buffers` back, on ``device``."""
    for sub, name, buf in saved:
        sub._buffers[name] = buf.to(device)


@contextmanager
def full_size_parameters(modules: list[nn.Module]) -> Iterator[None]:
    """Temporarily give ``modules``' own parameters full-size CPU storage; keep each rank's slice after.

    Inside, every (possibly sharded) parameter is replaced by an uninitialized full-size parameter
    (one per shared parameter, so tied weights stay one tensor). On exit, each rank copies its slice
    of the full values into the real parameter and the real parameters are put back.
    """
    places: list[tuple[nn.Module, str, nn.Parameter]] = [
        (sub, name, param) for sub in modules for name, param in sub._parameters.items() if param is not None
    ]
    full: dict[int, nn.Parameter] = {}
    originals: dict[int, nn.Parameter] = {}
    for sub, name, param in places:
        if id(param) not in full:
            full[id(param)] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device="cpu"), requires_grad=param.requires_grad
            )
            originals[id(param)] = param
        sub._parameters[name] = full[id(param)]
    try:
        yield
        with torch.no_grad():
            for key, param in originals.items():
                copy_local_slice(param, full[key].data)
    finally:
        for sub, name, param in places:
            sub._parameters[name] = param


def copy_local_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``param`` (a DTensor shard or a plain tensor)."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor and takes its slice, no comms.
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full)


def _reset_at_full_size(sub: nn.Module, reset: Callable[[], None]) -> Callable[[], None]:
    def reset_parameters() -> None:
        with full_size_parameters([sub]):
            reset()

    return reset_parameters


@contextmanager
def resets_at_full_size(module: nn.Module) -> Iterator[None]:
    """Inside, each submodule's ``reset_parameters()`` runs on full-size copies of its own parameters."""
    patched: list[tuple[nn.Module, object]] = []
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset) and any(p is not None for p in sub._parameters.values()):
            patched.append((sub, sub.__dict__.get("reset_parameters")))
            sub.reset_parameters = _reset_at_full_size(sub, reset)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for sub, previous in patched:
            if previous is None:
                del sub.reset_parameters
            else:
                sub.reset_parameters = previous  # type: ignore[method-assign,assignment]


def initialize_sharded(module: nn.Module, rng_state: torch.Tensor | None) -> None:
    """Initialize a materialized sharded module to the same full weights a single process gets."""
    if callable(getattr(module, "init_weights", None)):
        with full_size_parameters(list(module.modules())):
            initialize_weights(module, rng_state)
    else:
        with resets_at_full_size(module):
            initialize_weights(module, rng_state)


def materialize_sharded(module: nn.Module, device: torch.device, rng_state: torch.Tensor | None) -> None:
    """Give a sharded meta module's shards real storage on ``device`` and initialize them.

    Call after ``fully_shard`` (so each rank allocates only its shard) with the RNG state recorded
    before sharding (:func:`minifabric.strategies.meta_init.init_rng_state`).
    """
    buffers = real_buffers(module)
    # Swapping keeps each Parameter object (so tied weights stay one parameter, the one FSDP
    # manages); FSDP2's _apply then re-points FSDP at the new shard storage.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device, recurse=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    restore_buffers(buffers, device)
    initialize_sharded(module, rng_state)
