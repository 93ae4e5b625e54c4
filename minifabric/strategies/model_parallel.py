"""2-D parallelism: the user's tensor-parallel plan inside a group, FSDP across groups.

Lightning Fabric's ``ModelParallelStrategy`` hands ``parallelize_fn(model, device_mesh)`` a 2-D mesh
``("data_parallel", "tensor_parallel")`` and leaves the rest to it. This one runs the same function,
then does what the function left undone, so that every parameter ends up in one consistent layout
(a DTensor sharded over the data-parallel dimension, and over the tensor-parallel one where the plan
put it) and clipping, optimizers, meta-device init and checkpoints work as under ``"fsdp"``:

1. ``parallelize_fn`` (its plan is checked: a key that names no submodule, a sharded size that
   ``tp`` does not divide, a return value that is not a module raise on every rank);
2. FSDP over the data-parallel dimension for whatever the function did not shard with
   ``fully_shard`` (each repeated block, then the root), with the accelerator's precision as the
   mixed-precision policy unless the function chose one;
3. materialization of a model built in ``init_module(empty_init=True)``: each parameter now in the
   model (also one that a module swapped in by ``parallelize_fn`` took over) is initialized at full
   size, exactly as one process would, and this rank keeps its slice. A model built under plain
   ``torch.device("meta")`` is materialized before step 1, as under ``"fsdp"``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from minifabric._torch import fsdp_policy, unresolved_plan_keys
from minifabric.init import following_init_records, recorded_places
from minifabric.runtime.environment import DEFAULT_TIMEOUT
from minifabric.strategies.compile import (
    Compiler,
    compile_children_in_place,
    compile_modules,
    split_compiled,
)
from minifabric.strategies.fsdp import without_gradient_sync
from minifabric.strategies.fsdp_grads import clip_grad_norm_
from minifabric.strategies.fsdp_wrap import (
    ShardSettings,
    apply_activation_checkpointing,
    mesh_after_launch,
    mixed_precision_policy,
    select_blocks,
    shard_model,
    sharded_submodules,
)
from minifabric.strategies.model_parallel_checks import (
    DP,
    TP,
    SizeOption,
    build_2d_mesh,
    check_parallelized,
    check_size_option,
    check_ties_kept,
    resolve_sizes,
    tied_parameters,
)
from minifabric.strategies.rank_zero_init import keep_rank_zero_tensors
from minifabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    pass

TModel = TypeVar("TModel", bound=nn.Module)


class ModelParallelStrategy(Strategy):
    """Tensor parallel (your plan) x FSDP, on a 2-D device mesh ``("data_parallel", "tensor_parallel")``.

    Lightning Fabric's signature and meaning: ``parallelize_fn(model, device_mesh)`` applies
    tensor parallelism (``parallelize_module`` with ``device_mesh["tensor_parallel"]``) and may
    apply ``fully_shard`` itself (with ``device_mesh["data_parallel"]``); it returns the model. A
    Fabric script runs with only the import changed. Beyond Fabric, what the function leaves
    undone is done here: parameters it did not shard with FSDP are sharded over the data-parallel
    dimension (each repeated block, then the root), the accelerator's ``precision`` becomes the
    FSDP mixed-precision policy unless the function passed one, ``init_module(empty_init=True)``
    gives the weights of eager construction, and ``clip_gradients`` takes the norm across both
    meshes. Data loaders are split by the data-parallel rank: the ranks of one tensor-parallel
    group get the same batches.

    Args:
        parallelize_fn: ``(model, device_mesh) -> model``.
        data_parallel_size: number of data-parallel groups (FSDP shards over them). ``"auto"``: the
            number of nodes, or the world size divided by ``tensor_parallel_size`` when that is given.
        tensor_parallel_size: ranks per tensor-parallel group. ``"auto"``: the processes per node,
            or the world size divided by ``data_parallel_size`` when that is given.
        save_distributed_checkpoint: ``True``: each rank writes its shard (a checkpoint folder);
            ``False``: one full file written by rank 0. ``load`` reads both, at any mesh.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: nccl on CUDA, gloo on CPU.
        timeout: collective timeout (``timedelta`` or seconds).
        activation_checkpointing_policy: module classes whose activations are recomputed in
            backward (applied before ``parallelize_fn``; parameter names stay the same, so
            checkpoints load into a model without it).

    Raises:
        ValueError: a size is not ``"auto"`` or a positive int; at ``Accelerator(...)``, when
            ``data_parallel_size * tensor_parallel_size`` is not the world size.

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        >>> from minifabric import Accelerator, ModelParallelStrategy
        >>> def parallelize(model, device_mesh):
        ...     parallelize_module(model, device_mesh["tensor_parallel"], {"0": ColwiseParallel()})
        ...     return model
        >>> strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2)
        >>> acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2)
    """

    def __init__(
        self,
        parallelize_fn: Callable[[TModel, DeviceMesh], TModel],
        data_parallel_size: SizeOption = "auto",
        tensor_parallel_size: SizeOption = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        *,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend)
        if not callable(parallelize_fn):
            raise TypeError(
                f"parallelize_fn must be a function (model, device_mesh) -> model, got {parallelize_fn!r}:"
                " `ModelParallelStrategy(parallelize)`."
            )
        check_size_option("data_parallel_size", data_parallel_size)
        check_size_option("tensor_parallel_size", tensor_parallel_size)
        if not isinstance(save_distributed_checkpoint, bool):
            raise TypeError(
                f"save_distributed_checkpoint must be True or False, got {save_distributed_checkpoint!r}."
            )
        policy = activation_checkpointing_policy or set()
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
            raise TypeError(
                "activation_checkpointing_policy must be a set of nn.Module classes, got"
                f" {activation_checkpointing_policy!r}, e.g. `activation_checkpointing_policy={{Block}}`."
            )
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size: SizeOption = data_parallel_size
        self.tensor_parallel_size: SizeOption = tensor_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.activation_checkpointing_policy = set(policy)
        self._mesh: DeviceMesh | None = None
        self.state_dict_type = "sharded" if save_distributed_checkpoint else "full"
        self._sizes: tuple[int, int] | None = None
        self._autocast = False  # whether some model's FSDP policy leaves the precision to autocast

    # ---- the world ---------------------------------------------------------------------------

    def _check_world(self) -> None:
        """Fix the mesh sizes for the world; raise if they do not fit it."""
        self._sizes = resolve_sizes(
            self.data_parallel_size, self.tensor_parallel_size, self.num_nodes, self.num_processes
        )

    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()  # DTensor and fully_shard need a process group even with one process

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(data_parallel, tensor_parallel)`` mesh (built on first use, after ``launch``)."""
        if self._mesh is None:

            def build() -> DeviceMesh:
                if self._sizes is None:
                    raise RuntimeError("ModelParallelStrategy is used before an Accelerator was built with it.")
                return build_2d_mesh(self.root_device.type, *self._sizes)

            self._mesh = mesh_after_launch(
                build,
                "The device mesh",
                "`acc.setup(model)` or reading `strategy.device_mesh`",
            )
        return self._mesh

    mesh = device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The data-parallel group count and this rank's group: one tensor-parallel group reads one split."""
        dp_mesh = self.device_mesh[DP]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ---- modules -----------------------------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Run ``parallelize_fn``, shard what it left plain over the data-parallel mesh, materialize.

        A model built in ``init_module(empty_init=True)`` is materialized last, and what is
        materialized is found by the tensors now in the model, not by the modules that held them
        before ``parallelize_fn`` ran: a module it swapped in (``from_float``-style, taking over the
        old ``Parameter`` objects) gets their values; a meta tensor it made without taking one over
        is refused, naming it. A model built under plain ``torch.device("meta")`` is materialized
        first, as under ``"fsdp"`` (each module's ``reset_parameters()``, Lightning Fabric's way).
        Before ``parallelize_fn`` runs, every rank takes rank 0's real (eagerly built) tensors where
        any rank's differ (a script that seeded each rank differently before building the model),
        as under ``"fsdp"``: the function shards one model, not each rank's own draws.
        """
        module, compiler = self._compiler(module)
        places = self._recorded_places(module)  # raises before any collective if an init cannot be reproduced
        if self.world_size > 1:  # per-rank seeds before construction: parallelize_fn shards rank 0's tensors
            keep_rank_zero_tensors(module, self.root_device)
        fn = getattr(self.parallelize_fn, "__name__", repr(self.parallelize_fn))
        if not places:
            parallelized = self.parallelize(module.to(self.root_device), compiler)
            recorded_places(parallelized, rebuilt_by=f"parallelize_fn {fn!r}")  # a meta tensor it made: refused
            return parallelized
        with following_init_records(places, module):  # a record follows its tensor into a module the function built
            parallelized = self.parallelize(module, compiler)
        places = recorded_places(parallelized, rebuilt_by=f"parallelize_fn {fn!r}")
        self._materialize(parallelized, places, self.root_device, self.root_device, built=module)
        return parallelized

    def parallelize(self, module: nn.Module, compiler: Compiler | None = None) -> nn.Module:
        """Lay ``module`` out over the mesh where it is: precision, activation checkpointing, the plan, FSDP.

        The step of :meth:`setup_module` that decides what each rank holds. It moves and
        materializes nothing, so it also runs on a model on the meta device (the memory estimator
        does that on a fake world) and the DTensors it leaves carry each rank's local shape.
        """
        module = self.precision.convert_module(module)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        fn: Callable[[nn.Module, DeviceMesh], Any] = self.parallelize_fn  # type: ignore[assignment]
        ties = tied_parameters(module)
        with unresolved_plan_keys() as plan_warnings:
            parallelized = fn(module, self.device_mesh)
        module = check_parallelized(parallelized, fn, plan_warnings, self.device_mesh[TP].size())
        # `return torch.compile(model)` or `model.blocks[i] = torch.compile(block)` in the function:
        # set up the original modules (names without `_orig_mod.`), compiled in place with its options.
        module, fn_compiler = split_compiled(module)
        compile_children_in_place(module)
        check_ties_kept(ties, module, fn)
        compiler = compiler or fn_compiler
        policy = self._shard_the_rest(module, compiler)
        self._autocast |= self.precision.is_mixed and policy.param_dtype is None
        return module

    def _shard_the_rest(self, module: nn.Module, compiler: Any) -> MixedPrecisionPolicy:
        """``fully_shard`` over the data-parallel mesh what ``parallelize_fn`` did not; return the root's policy."""
        user_units = sharded_submodules(module)
        if compiler is not None and (isinstance(module, FSDPModule) or user_units):
            # Compiling the whole model around the function's FSDP units (or after its root
            # `fully_shard`) fails inside torch.compile with "Mixing fake modes".
            raise TypeError(
                f"{type(module).__name__} is compiled as a whole (`torch.compile(model)`), but parallelize_fn"
                " already applied `fully_shard` itself. Compile each block in place inside the function,"
                " before its `fully_shard`: `block.compile(); fully_shard(block, mesh=...)`; or leave"
                " `fully_shard` to the strategy, which then compiles each block before sharding it."
            )
        if isinstance(module, FSDPModule):
            return fsdp_policy(module)
        # The function's own `fully_shard` calls chose a policy (maybe the default): the root follows it.
        policy = fsdp_policy(user_units[0]) if user_units else mixed_precision_policy(self.precision)
        if user_units and policy.output_dtype is None and self.precision.is_mixed:
            policy = MixedPrecisionPolicy(
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype,
                output_dtype=torch.float32 if policy.param_dtype is not None else None,
                cast_forward_inputs=policy.cast_forward_inputs,
            )
        blocks = [] if user_units else select_blocks(module, None)
        if compiler is not None:
            compile_modules(blocks or [module], compiler)
        shard_model(module, blocks, ShardSettings(self.device_mesh[DP], True, policy))
        return policy

    def forward_context(self) -> ContextManager:
        # FSDP's policy casts when it has a param_dtype; autocast is needed only where it does not.
        return self.precision.forward_context() if self._autocast else nullcontext()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Inside, gradients accumulate unreduced over the data-parallel mesh (tensor-parallel
        collectives of forward and backward still run: they compute the micro-batch itself)."""
        if not enabled or not isinstance(module, FSDPModule):
            return nullcontext()
        return without_gradient_sync(module)

    #: the norm over all shards, a plain tensor equal on every rank (see `Strategy.clip_gradients_norm`)
    _clip_grad_norm = staticmethod(clip_grad_norm_)

    # `barrier`, `broadcast`, `all_gather`, `all_reduce` are the base class's: over all ranks of
    # the run (the default group), not over one data- or tensor-parallel group.
