"""Applying FSDP2 to a model: plain functions over a module and a device mesh.

The FSDP strategy calls these in order: :func:`build_mesh`, :func:`select_blocks`,
:func:`apply_activation_checkpointing`, :func:`shard_model`. Each one is usable on its own, e.g. in
a hand-written FSDP2 loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from minifabric._torch import activations_checkpointed, checkpoint_activations
from minifabric.parameters import TensorPlace, shared_tensors
from minifabric.precision import Precision

log = logging.getLogger(__name__)

ShardingStr = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
#: ``None`` (find repeated blocks), a set of module classes, or ``(module, name) -> bool``.
WrapPolicy = set[type[nn.Module]] | Callable[[nn.Module, str], bool] | None


def check_sharded_parameters(optimizer: Optimizer) -> None:
    """Refuse an optimizer that holds a parameter ``fully_shard`` did not shard.

    Every parameter of a model set up under FSDP is a DTensor. A plain tensor in the optimizer
    belongs to no set-up model: each rank would step its own copy with its own gradient, never
    reduced, and the ranks would drift apart without an error.

    Raises:
        ValueError: naming how many such parameters, their shapes, and the fix.
    """
    plain = [p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(plain)} parameter(s) that no model set up with"
            f" FSDPStrategy owns (shapes: {', '.join(str(tuple(p.shape)) for p in plain[:4])}): each"
            " rank would update its own copy with unreduced gradients. Set up the model that owns"
            " them first, `model = acc.setup(model)`, then `optimizer = acc.setup_optimizers(optimizer)`"
            " (or `acc.setup(model, optimizer)`); a module that holds trainable parameters (a learned"
            " loss scale, a head) must be part of the model passed to `setup`."
        )


def mesh_after_launch(build: Callable[[], DeviceMesh], mesh: str, needed_by: str) -> DeviceMesh:
    """``build()``, once the process group exists (a strategy builds its mesh on first use).

    Raises:
        RuntimeError: before ``acc.launch()``, naming the ``mesh`` and the calls that need it.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError(f"{mesh} needs the process group. Call `acc.launch()` before {needed_by}.")
    return build()


def build_mesh(
    sharding_strategy: ShardingStr,
    device_type: str,
    num_nodes: int,
    num_processes: int,
    shape: tuple[int, int] | None = None,
) -> DeviceMesh:
    """The device mesh ``fully_shard`` shards over.

    A 1-D mesh over all ranks for ``FULL_SHARD``/``SHARD_GRAD_OP``. FSDP2 expresses the others as a
    2-D mesh ``(replicate, shard)``: parameters are replicated along the first dimension and sharded
    along the second. ``HYBRID_SHARD`` replicates across nodes and shards within a node;
    ``NO_SHARD`` replicates across every rank (a shard dimension of size 1). ``shape`` chooses
    ``(replicas, shards)`` for ``HYBRID_SHARD`` instead: a shard group is ``shards`` consecutive
    ranks, so with ``shards`` dividing the devices per node the all-gathers stay inside a node.
    """
    world_size = num_nodes * num_processes
    if sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if sharding_strategy != "HYBRID_SHARD":
        shape = (world_size, 1)
    elif shape is None:
        shape = (num_nodes, num_processes)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for a precision plugin (for the root module; see :func:`inner_policy`).

    Mixed precision keeps float32 sharded (master) parameters, gathers them in the compute dtype and
    reduces gradients in float32. The root casts its output back to float32. "*-true" precisions
    store the parameters in their dtype already, so FSDP has nothing to cast.
    """
    if not precision.is_mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=precision.compute_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
    )


def inner_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy for non-root modules: no ``output_dtype``.

    Casting every block's output back to float32 would feed float32 activations into the next
    block's low-precision matmuls (a dtype mismatch); only the root's output is cast.
    """
    return dataclasses.replace(policy, output_dtype=None)


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's offload policy.

    With ``cpu_offload`` the sharded parameters, gradients and optimizer state live in CPU memory
    and the optimizer steps on the CPU; parameters are copied to the device for forward/backward.
    On a CPU-only run everything is in CPU memory already, so offloading changes nothing (and
    pinned memory needs an accelerator, hence ``pin_memory=False`` there).
    """
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_block_classes(module: nn.Module) -> set[type[nn.Module]]:
    """Classes that occur several times in one container (e.g. the blocks in a ``ModuleList``).

    Searches top-down and does not look inside a block once its class is chosen, so the linear
    layers inside a transformer block are not chosen as well. Only children of containers count:
    two embeddings that sit side by side as attributes are not "repeated blocks". Classes without
    parameters (activations, dropout) never count.
    """
    found: set[type[nn.Module]] = set()

    def visit(parent: nn.Module) -> None:
        children = [c for c in parent.children() if any(True for _ in c.parameters())]
        if isinstance(parent, _CONTAINERS):
            counts = Counter(type(c) for c in children)
            found.update(cls for cls, n in counts.items() if n > 1)
        for child in children:
            if type(child) not in found:
                visit(child)

    visit(module)
    return found


def _splits_tied(block: nn.Module, groups: list[list[TensorPlace]]) -> bool:
    """Whether ``block`` holds a parameter that is shared with a module outside it."""
    inside = set(map(id, block.modules()))
    return any(
        any(id(p.module) in inside for p in group) and not all(id(p.module) in inside for p in group)
        for group in groups
    )


def select_blocks(module: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The submodules to shard as their own units, children before parents (never the root).

    A module that shares a parameter with a module outside it (a tied embedding) cannot be its
    own unit: the automatic choice skips it, an explicit policy raises.

    Raises:
        ValueError: an explicit ``policy`` matched no submodule, or matched a tied one.
    """
    if policy is None:
        classes = tuple(repeated_block_classes(module))
        names = sorted(cls.__name__ for cls in classes)
        log.info(
            "FSDP auto-wrap: sharding each %s as its own unit", ", ".join(names) or "(no repeated block)"
        )
        matches: Callable[[nn.Module, str], bool] = lambda m, _: bool(classes) and isinstance(m, classes)  # noqa: E731
    elif isinstance(policy, (set, frozenset)):
        matches = lambda m, _: isinstance(m, tuple(policy))  # noqa: E731
    else:
        matches = policy
    groups = shared_tensors(module)
    chosen = []
    for name, sub in module.named_modules():
        if not name or not matches(sub, name):
            continue
        if _splits_tied(sub, groups):
            if policy is None:
                continue
            raise ValueError(
                f"auto_wrap_policy={_describe(policy)} selects {name!r} ({type(sub).__name__}), which shares a"
                " parameter with a module outside it (tied weights). Tied modules must stay in one unit:"
                " leave them to the root, e.g. `FSDPStrategy(auto_wrap_policy={Block})`."
            )
        chosen.append(sub)
    if policy is not None and not chosen:
        raise ValueError(
            f"auto_wrap_policy={_describe(policy)} matched no submodule of {type(module).__name__}. Pass the"
            " classes of its repeated blocks, e.g. `FSDPStrategy(auto_wrap_policy={Block})`, or leave it"
            " out to find them automatically."
        )
    # named_modules() lists parents before children; sharding must go bottom-up.
    return chosen[::-1]


def _describe(policy: Any) -> str:
    if isinstance(policy, (set, frozenset)):
        return "{" + ", ".join(sorted(cls.__name__ for cls in policy)) + "}"
    return repr(policy)


def apply_activation_checkpointing(module: nn.Module, classes: Iterable[type[nn.Module]]) -> int:
    """Recompute the activations of every submodule of one of ``classes`` in backward.

    Returns how many submodules were checkpointed. Apply before sharding, as torchtitan does.
    """
    classes = tuple(classes)
    targets = [
        sub
        for sub in module.modules()
        if classes
        and isinstance(sub, classes)
        and not activations_checkpointed(sub)  # `wrap` may have done it
    ]
    for sub in targets:
        checkpoint_activations(sub)
    return len(targets)


def sharded_submodules(module: nn.Module) -> list[nn.Module]:
    """Submodules (not the root) that are already sharded, e.g. by :func:`minifabric.wrap`."""
    return [sub for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)]


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    """The arguments of every ``fully_shard`` call of one model, as one value.

    ``reshard_after_forward`` is the blocks'; :func:`shard_model` derives the root's from it.
    """

    mesh: DeviceMesh
    reshard_after_forward: bool | None
    mp_policy: MixedPrecisionPolicy
    offload: OffloadPolicy = dataclasses.field(default_factory=OffloadPolicy)

    def apply(self, module: nn.Module) -> None:
        """``fully_shard(module, ...)`` with these settings."""
        fully_shard(
            module,
            mesh=self.mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self.offload,
        )


def shard_norms_in_float32(module: nn.Module, settings: ShardSettings) -> None:
    """Shard each batch-norm layer under ``module`` as its own unit that keeps float32 parameters.

    Under a low-precision ``param_dtype`` a batch norm would get bf16/fp16 weights next to its
    float32 running statistics, which ``batch_norm`` refuses. As with autocast (and FSDP1's
    mixed precision), the layer keeps float32 weights and statistics and takes the low-precision
    activations as they are; its output stays in their dtype.
    """
    for sub in list(module.modules()):
        if sub is not module and _is_low_precision_norm(sub, settings.mp_policy):
            dataclasses.replace(settings, mp_policy=_float32_norm_policy(settings.mp_policy)).apply(sub)


def _is_low_precision_norm(module: nn.Module, mp_policy: MixedPrecisionPolicy) -> bool:
    """Whether ``module`` is an unsharded batch norm with weights that ``mp_policy`` would cast down."""
    return (
        mp_policy.param_dtype not in (None, torch.float32)
        and isinstance(module, _BATCH_NORMS)
        and not isinstance(module, FSDPModule)
        and any(True for _ in module.parameters(recurse=False))
    )


def _float32_norm_policy(mp_policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """``mp_policy`` for a batch norm: float32 weights, activations taken in the dtype they come in."""
    return MixedPrecisionPolicy(
        reduce_dtype=mp_policy.reduce_dtype, output_dtype=mp_policy.output_dtype, cast_forward_inputs=False
    )


def shard_module(module: nn.Module, settings: ShardSettings) -> nn.Module:
    """``fully_shard`` one module in place (its batch norms first, in float32) and return it.

    A batch norm that is itself the unit (auto-wrap picks the repeated ``BatchNorm2d`` layers of a
    DCGAN's ``nn.Sequential``) keeps float32 weights too.
    """
    shard_norms_in_float32(module, settings)
    if _is_low_precision_norm(module, settings.mp_policy):
        settings = dataclasses.replace(settings, mp_policy=_float32_norm_policy(settings.mp_policy))
    settings.apply(module)
    return module


def shard_model(module: nn.Module, blocks: list[nn.Module], settings: ShardSettings) -> nn.Module:
    """Shard each of ``blocks`` (children first), then the root, which takes the remaining parameters.

    Each block's parameters are gathered just before its forward and freed after it, so the peak
    holds one block unsharded. ``settings.mp_policy`` is the root's; blocks get :func:`inner_policy`.
    """
    for block in blocks:
        shard_module(block, dataclasses.replace(settings, mp_policy=inner_policy(settings.mp_policy)))
    # The root's parameters are used again at the start of backward: resharding them after forward
    # would only all-gather them once more. FSDP2 skips that for the root only when the argument is
    # left to it (None); an explicit True reshards the root too.
    root = None if settings.reshard_after_forward else False
    shard_module(module, dataclasses.replace(settings, reshard_after_forward=root))
    return module
