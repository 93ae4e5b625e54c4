"""Lightning Fabric's ``FSDPStrategy`` keyword arguments (FSDP1's) read as their FSDP2 meaning.

Fabric users pass FSDP1 options: ``cpu_offload=CPUOffload(...)``, ``mixed_precision=MixedPrecision(...)``,
``sharding_strategy=ShardingStrategy.FULL_SHARD``, ``ModuleWrapPolicy`` objects, and FSDP1 keyword
arguments (``limit_all_gathers``, ``use_orig_params``, ...). Each is mapped to what FSDP2 does, or
accepted with one warning where FSDP2 has no such knob; an unknown name raises.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

#: FSDP1 options with no FSDP2 knob: accepted, named in one warning, no effect
IGNORED = MappingProxyType({
    "limit_all_gathers": "FSDP2 limits in-flight all-gathers by itself",
    "use_orig_params": "FSDP2 always trains the original parameters (as DTensors)",
    "forward_prefetch": "FSDP2 overlaps all-gathers with compute by itself; for explicit prefetching call"
    " `block.set_modules_to_forward_prefetch([next_block])` after setup",
    "backward_prefetch": "FSDP2 prefetches the next block's all-gather in backward by itself",
    "device_id": "the device comes from the Accelerator",
})
#: FSDP1 options that cannot be honoured: raise with what to do instead
REFUSED = MappingProxyType({
    "param_init_fn": "build the model in `acc.init_module(empty_init=True)`; `setup` materializes and initializes it",
    "ignored_modules": "keep such modules outside the model passed to `acc.setup`",
    "ignored_states": "keep such parameters outside the model passed to `acc.setup`",
    "process_group": 'sharding spans every rank; use sharding_strategy="HYBRID_SHARD" to shard within nodes',
})


def _classes_of_policy(policy: Any, name: str) -> Any:
    """An FSDP1 wrap policy (``ModuleWrapPolicy``, ``partial(transformer_auto_wrap_policy, ...)``) as a set of classes."""
    classes = getattr(policy, "_module_classes", None)
    if classes is None and isinstance(policy, functools.partial):
        classes = policy.keywords.get("transformer_layer_cls") or policy.keywords.get("module_classes")
    if classes is not None:
        return set(classes)
    if callable(policy) and not isinstance(policy, type):
        try:
            parameters = inspect.signature(policy).parameters
        except (TypeError, ValueError):
            return policy
        if "recurse" in parameters or "nonwrapped_numel" in parameters:
            raise TypeError(
                f"{name}={policy!r} is an FSDP1 size- or recursion-based policy, which FSDP2 has no"
                f" equivalent for. Pass the block classes instead, e.g. `FSDPStrategy({name}={{Block}})`,"
                " or a callable `(module, name) -> bool`."
            )
    return policy


def _offload(cpu_offload: Any) -> Any:
    if type(cpu_offload).__name__ == "CPUOffload" and hasattr(cpu_offload, "offload_params"):
        return bool(cpu_offload.offload_params)
    return cpu_offload


def _mixed_precision(mixed_precision: Any, ignored: dict[str, str]) -> Any:
    """FSDP1's ``MixedPrecision`` as FSDP2's ``MixedPrecisionPolicy`` (parameter and reduce dtypes)."""
    if type(mixed_precision).__name__ != "MixedPrecision" or not hasattr(mixed_precision, "buffer_dtype"):
        return mixed_precision
    if mixed_precision.buffer_dtype is not None:
        ignored["mixed_precision.buffer_dtype"] = "FSDP2 keeps buffers in their own dtype"
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs,
    )


def translate_fabric_options(options: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Return ``options`` with FSDP1 values mapped to FSDP2 ones, plus ``sync_module_states``.

    ``extra`` holds the keyword arguments ``FSDPStrategy`` does not name itself.

    Raises:
        TypeError: an unknown keyword argument, or an FSDP1 policy with no FSDP2 equivalent.
        ValueError: an FSDP1 option that cannot be honoured (``param_init_fn``, ``ignored_modules``, ...).
    """
    out = dict(options)
    ignored: dict[str, str] = {}
    out["cpu_offload"] = _offload(out["cpu_offload"])
    out["mixed_precision"] = _mixed_precision(out["mixed_precision"], ignored)
    strategy = out["sharding_strategy"]
    if type(strategy).__name__ == "ShardingStrategy":
        out["sharding_strategy"] = strategy.name
    out["auto_wrap_policy"] = _classes_of_policy(out["auto_wrap_policy"], "auto_wrap_policy")
    out["activation_checkpointing_policy"] = _classes_of_policy(
        out["activation_checkpointing_policy"], "activation_checkpointing_policy"
    )
    checkpointing = extra.pop("activation_checkpointing", None)  # Fabric's older spelling
    if checkpointing is not None:
        classes = checkpointing if isinstance(checkpointing, (list, tuple, set)) else [checkpointing]
        out["activation_checkpointing_policy"] = set(out["activation_checkpointing_policy"] or ()) | set(
            classes
        )
    out["sync_module_states"] = bool(extra.pop("sync_module_states", False))
    for name in list(extra):
        if name in REFUSED:
            raise ValueError(f"FSDPStrategy({name}=...) has no FSDP2 equivalent here: {REFUSED[name]}.")
        if name in IGNORED:
            ignored[name] = IGNORED[name]
            extra.pop(name)
    if extra:
        unknown = ", ".join(map(repr, sorted(extra)))
        raise TypeError(
            f"FSDPStrategy got unknown keyword arguments {unknown}. It takes auto_wrap_policy,"
            " activation_checkpointing_policy, sharding_strategy, cpu_offload, state_dict_type,"
            f" mixed_precision, timeout, process_group_backend, and Fabric's FSDP1 options {', '.join(sorted(IGNORED))},"
            " sync_module_states, activation_checkpointing."
        )
    if ignored:
        reasons = "; ".join(f"{name}: {why}" for name, why in ignored.items())
        warnings.warn(
            f"FSDPStrategy ignores FSDP1 options that FSDP2 has no knob for ({reasons}).",
            UserWarning,
            stacklevel=3,
        )
    return out


def broadcast_module_states(module: nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers (``sync_module_states=True``), before sharding."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    module.to(device)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def check_device_mesh(device_mesh: Any, sharding_strategy: str) -> Any:
    """Validate ``FSDPStrategy(device_mesh=...)``: ``(replicas, shards)`` or a torch ``DeviceMesh``; return it.

    Raises:
        ValueError: a shape that is not two positive ints, or a mesh whose number of dimensions does
            not fit ``sharding_strategy`` (2-D ``(replicate, shard)`` for HSDP, 1-D for the others).
        TypeError: anything else.
    """
    if device_mesh is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    hybrid = sharding_strategy == "HYBRID_SHARD"
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim != (2 if hybrid else 1):
            raise ValueError(
                f"device_mesh has {device_mesh.ndim} dimension(s); sharding_strategy={sharding_strategy!r} needs"
                f" {'a 2-D (replicate, shard)' if hybrid else 'a 1-D'} mesh, e.g."
                ' `init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))`.'
            )
        return device_mesh
    if isinstance(device_mesh, list):
        device_mesh = tuple(device_mesh)
    valid = (
        isinstance(device_mesh, tuple)
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in device_mesh)
    )
    if not valid:
        raise ValueError(
            f"device_mesh={device_mesh!r} must be (replicas, shards), two positive ints, or a torch"
            ' DeviceMesh, e.g. `FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4))`.'
        )
    if not hybrid:
        raise ValueError(
            f"device_mesh={device_mesh!r} describes hybrid sharding (replicas x shards), but"
            f" sharding_strategy={sharding_strategy!r}. Use"
            f' `FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh={device_mesh!r})`.'
        )
    return device_mesh


def check_mesh_size(device_mesh: Any, world_size: int) -> None:
    """Raise ``ValueError`` if a ``(replicas, shards)`` device mesh does not cover ``world_size`` ranks."""
    if isinstance(device_mesh, tuple) and device_mesh[0] * device_mesh[1] != world_size:
        replicas, shards = device_mesh
        raise ValueError(
            f"device_mesh=({replicas}, {shards}) holds {replicas * shards} ranks, but the run has"
            f" {world_size}: replicas x shards must equal it, e.g."
            f' `FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=({max(world_size // shards, 1)},'
            f" {shards if world_size % shards == 0 else world_size}))`."
        )
