"""Materializing a sharded model that was built on the meta device: each rank keeps only its shard.

Random init cannot run on the shards directly: on CPU, torch's sharded RNG tracker is not used, so
every rank would fill its slice from the same random stream. Instead each parameter's recorded init
is replayed at full size on the CPU (:func:`minifabric.strategies.init_replay.evaluate`, exactly as
for one process) and each rank copies out its own slice. Only one parameter exists at full size at
a time, so the peak per rank is its shards plus the largest parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric._torch import local_slice
from minifabric.strategies.init_replay import evaluate
from minifabric.strategies.meta_init import Place, forget_init_records


def copy_local_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``param`` (a DTensor shard or a plain tensor).

    The slice is cut on the CPU and copied straight into the shard, wherever it lives (the device,
    or CPU memory under offloading): every rank holds the same full tensor, so no comms are needed.
    """
    if isinstance(param, DTensor):
        param.to_local().copy_(local_slice(full, param.device_mesh, param.placements))
    else:
        param.copy_(full)


def materialize_sharded(
    module: nn.Module, places: list[Place], param_device: torch.device, buffer_device: torch.device
) -> None:
    """Give a sharded meta module's shards real storage and their eager-construction values.

    Call after ``fully_shard`` (so each rank allocates only its shard) with the places taken before
    sharding (:func:`minifabric.strategies.meta_init.init_places`). Parameters go to
    ``param_device`` (the CPU when FSDP offloads them), buffers to ``buffer_device``.
    """
    real = [
        (sub, name, buf)
        for sub in module.modules()
        for name, buf in sub._buffers.items()
        if buf is not None and not buf.is_meta
    ]
    # Swapping keeps each Parameter object (so tied weights stay one parameter, the one FSDP
    # manages); FSDP2's _apply then re-points FSDP at the new shard storage.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=param_device, recurse=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for sub, name, buf in real:  # to_empty wiped them: put back values computed in __init__
        sub._buffers[name] = buf.to(buffer_device)
    done: set[int] = set()
    with torch.no_grad():
        for sub, name, is_param, base in places:
            if not is_param:
                dtype: Any = sub._buffers[name].dtype  # type: ignore[union-attr]
                sub._buffers[name] = evaluate(base).to(device=buffer_device, dtype=dtype)
                continue
            param: Any = sub._parameters[name]
            if id(param) in done:
                continue
            done.add(id(param))
            copy_local_slice(param, evaluate(base).to(param.dtype))
    forget_init_records(module)
