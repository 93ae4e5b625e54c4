"""The 2-D (tensor parallel x FSDP) model for :func:`minifabric.estimate.estimate_memory`.

FSDP2 builds a new ``DeviceMesh`` when it shards a tensor-parallel parameter, which cannot be done
under ``FakeTensorMode``. So the model is built on the meta device, split by the user's
``parallelize_fn`` and sharded with FSDP over the data-parallel dimension exactly as
``ModelParallelStrategy`` does, all outside fake mode (meta tensors hold no memory), and then
given fake storage: each rank's local shards, with their real shapes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minifabric._torch import swapping_module_params
from minifabric.precision import Precision
from minifabric.strategies.fsdp_wrap import (
    ShardSettings,
    apply_activation_checkpointing,
    mixed_precision_policy,
    repeated_block_classes,
    select_blocks,
    shard_model,
)
from minifabric.strategies.model_parallel_checks import DP, build_2d_mesh


def sharded_meta_model(
    build: Callable[[], nn.Module],
    parallelize_fn: Callable[[nn.Module, Any], nn.Module],
    world_size: int,
    tensor_parallel_size: int,
    precision: Precision,
    activation_checkpointing: bool,
) -> nn.Module:
    """Build on meta, run ``parallelize_fn`` on the ``(data_parallel, tensor_parallel)`` mesh, FSDP the rest.

    Needs a (fake) process group of ``world_size`` ranks.
    """
    mesh = build_2d_mesh("cpu", world_size // tensor_parallel_size, tensor_parallel_size)
    with torch.device("meta"), precision.tensor_init_context():
        model = build()
    model = precision.convert_module(model).train()
    if activation_checkpointing:
        apply_activation_checkpointing(model, repeated_block_classes(model))
    model = parallelize_fn(model, mesh)
    settings = ShardSettings(mesh[DP], True, mixed_precision_policy(precision), _no_offload())
    shard_model(model, select_blocks(model, None), settings)
    return model


def give_fake_storage(model: nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake one of the same (local) shape; call under fake mode."""
    with swapping_module_params():
        model.to_empty(device="cpu")


def _no_offload() -> Any:
    from torch.distributed.fsdp import OffloadPolicy

    return OffloadPolicy()


def resolve_parallelize_fn(strategy: str, world_size: int, tp: Any, parallelize_fn: Any) -> Any:
    """The ``parallelize_fn`` to trace with (resolved from an import path), or None for 1-D strategies.

    Raises:
        ValueError: 2-D options with another strategy, a ``tensor_parallel_size`` that does not
            divide ``world_size``, or no usable ``parallelize_fn``.
    """
    if strategy != "model_parallel":
        if tp != 1 or parallelize_fn is not None:
            raise ValueError(
                f"tensor_parallel_size={tp!r} and parallelize_fn need strategy='model_parallel', got"
                f" strategy={strategy!r}."
            )
        return None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp!r} must be a positive int dividing world_size={world_size}, e.g."
            " tensor_parallel_size=2 with world_size=4."
        )
    if isinstance(parallelize_fn, str):
        module_name, sep, attr = parallelize_fn.partition(":")
        if not sep:
            raise ValueError(
                f"parallelize_fn={parallelize_fn!r} is not an import path: pass 'pkg.module:parallelize'."
            )
        parallelize_fn = getattr(importlib.import_module(module_name), attr)
    if not callable(parallelize_fn):
        raise ValueError(
            "strategy='model_parallel' needs parallelize_fn: the function ModelParallelStrategy runs,"
            f" or its import path 'pkg.module:parallelize'; got {parallelize_fn!r}."
        )
    return parallelize_fn
