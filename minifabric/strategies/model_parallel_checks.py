"""The 2-D (data parallel x tensor parallel) mesh and the checks run on what ``parallelize_fn`` returns.

Every check here is a pure function of the arguments and the module, so it gives the same answer on
every rank: a bad input raises on every rank at the same point, before any collective that could
leave the others waiting.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from minifabric.parameters import shared_tensors

#: the mesh dimension names Lightning Fabric uses, so a Fabric ``parallelize_fn`` runs unchanged
DP, TP = "data_parallel", "tensor_parallel"
SizeOption = int | Literal["auto"]


def check_size_option(name: str, value: Any) -> None:
    """Raise unless ``value`` is ``"auto"`` or a positive int."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f'{name}={value!r} must be "auto" or a positive int, e.g.'
            f" `ModelParallelStrategy(parallelize_fn, {name}=2)`."
        )


def resolve_sizes(
    data_parallel_size: SizeOption, tensor_parallel_size: SizeOption, num_nodes: int, num_processes: int
) -> tuple[int, int]:
    """``(dp, tp)`` for a world of ``num_nodes * num_processes`` ranks.

    Both ``"auto"``: as Lightning Fabric, ``dp = num_nodes`` and ``tp = num_processes`` (tensor
    parallel inside a node, where the links are fast; data parallel across nodes). One ``"auto"``:
    the other size divided into the world size.

    Raises:
        ValueError: ``dp * tp`` is not the world size (both numbers are named).
    """
    world = num_nodes * num_processes
    dp, tp = data_parallel_size, tensor_parallel_size
    if dp == "auto" and tp == "auto":
        dp, tp = num_nodes, num_processes
    elif dp == "auto":
        dp = world // tp if world % tp == 0 else -1  # type: ignore[operator]
    elif tp == "auto":
        tp = world // dp if world % dp == 0 else -1
    if dp * tp != world or dp < 1 or tp < 1:  # type: ignore[operator]
        raise ValueError(
            f"data_parallel_size={data_parallel_size!r} x tensor_parallel_size={tensor_parallel_size!r}"
            f" does not match the world size {world} ({num_nodes} node(s) x {num_processes} process(es)):"
            " the product must equal it, e.g. for 4 processes"
            " `ModelParallelStrategy(parallelize_fn, data_parallel_size=2, tensor_parallel_size=2)`."
        )
    return int(dp), int(tp)


def build_2d_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """The ``(data_parallel, tensor_parallel)`` mesh: ranks ``[i * tp, (i + 1) * tp)`` form TP group ``i``.

    Consecutive ranks share a tensor-parallel group, so with ``tp = devices per node`` the
    tensor-parallel collectives (one or two per layer, every step) stay inside a node.
    """
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(DP, TP))


def check_parallelized(module: Any, fn: Any, plan_warnings: list[str], tp: int) -> nn.Module:
    """Raise if ``parallelize_fn`` returned something unusable; return the module.

    Raises:
        TypeError: ``parallelize_fn`` did not return an ``nn.Module``.
        ValueError: a plan key matched no submodule (torch only warns and leaves that layer
            replicated), or a dimension sharded over the tensor-parallel mesh is not divisible by
            its size (the local shards would differ in shape, which breaks reshapes such as
            splitting attention heads; choose sizes divisible by ``tp``).
    """
    name = getattr(fn, "__name__", repr(fn))
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"parallelize_fn {name!r} returned {type(module).__name__}, not an nn.Module. It must return"
            " the model it parallelized: `def parallelize(model, device_mesh): ...; return model`."
        )
    if plan_warnings:
        raise ValueError(
            f"parallelize_fn {name!r} used a plan that names no submodule of {type(module).__name__}:"
            f" {'; '.join(plan_warnings)}. Use the names of `model.named_modules()`, e.g."
            ' `parallelize_module(block, mesh["tensor_parallel"], {"attn.qkv": ColwiseParallel()})`.'
        )
    for pname, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        for dim, placement in enumerate(param.placements):
            if placement.is_replicate() or placement.is_partial() or (mesh.mesh_dim_names or ())[dim] != TP:
                continue
            shard_dim = placement.dim  # type: ignore[attr-defined]  # Shard or _StridedShard
            size = param.shape[shard_dim]
            if size % tp:
                raise ValueError(
                    f"{pname!r} of shape {tuple(param.shape)} is sharded over tensor_parallel_size={tp}"
                    f" along dimension {shard_dim} of size {size}, which {tp} does not divide."
                    f" Choose layer sizes divisible by {tp} (e.g. {size + (-size) % tp}), or a"
                    " tensor_parallel_size that divides them."
                )
    return module


def tp_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters that live on a mesh with a tensor-parallel dimension."""
    return [
        name
        for name, p in module.named_parameters()
        if isinstance(p, DTensor) and TP in (p.device_mesh.mesh_dim_names or ())
    ]


_WRAPPER_COMPONENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _plain_name(name: str) -> str:
    for component in _WRAPPER_COMPONENTS:
        name = name.replace(component, "")
    return name


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one parameter (tied weights), wrapper components removed."""
    return [[_plain_name(place.name) for place in group] for group in shared_tensors(module)]


def check_ties_kept(ties: list[list[str]], module: nn.Module, fn: Any) -> None:
    """Raise if ``parallelize_fn`` made tied parameters separate ones.

    ``parallelize_module`` replaces each parameter of a planned layer with a new one, so a weight
    shared by two layers (an embedding tied to the output layer) silently becomes two weights that
    train apart: the model differs from one process. Names the function changed are not judged.

    Raises:
        ValueError: a group of tied names now holds more than one parameter (names and the fix).
    """
    params = {_plain_name(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    for names in ties:
        if not all(n in params for n in names) or len({id(params[n]) for n in names}) == 1:
            continue
        name = getattr(fn, "__name__", repr(fn))
        first, *others = names
        raise ValueError(
            f"parallelize_fn {name!r} untied {', '.join(map(repr, others))} from {first!r}: they were one"
            " parameter and are now separate ones, which train apart (one process keeps them equal)."
            " Tie them again at the end of the function, after `parallelize_module`, e.g."
            f" `model.{others[0]} = model.{first}` (both layers' plans must place the weight alike),"
            " or untie them in the model itself."
        )
