"""Fully sharded data parallel on FSDP2: each rank holds 1/N of parameters, gradients and optimizer state.

The wiring is done by plain functions (:mod:`~minifabric.strategies.fsdp_wrap` for the mesh and
``fully_shard``, :func:`minifabric.init.materialize` for sharded meta-device init,
:mod:`~minifabric.strategies.fsdp_grads` for clipping); this class only chooses and orders them.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Generator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.optim import Optimizer

from minifabric.init import keeping_init_records
from minifabric.runtime.environment import DEFAULT_TIMEOUT
from minifabric.strategies.compile import (
    CompileOption,
    Compiler,
    compile_modules,
)
from minifabric.strategies.fsdp_grads import clip_grad_norm_
from minifabric.strategies.fsdp_options import (
    broadcast_module_states,
    check_device_mesh,
    check_mesh_size,
    translate_fabric_options,
)
from minifabric.strategies.fsdp_wrap import (
    ShardingStr,
    ShardSettings,
    WrapPolicy,
    apply_activation_checkpointing,
    build_mesh,
    check_sharded_parameters,
    inner_policy,
    mesh_after_launch,
    mixed_precision_policy,
    offload_policy,
    select_blocks,
    shard_model,
    shard_module,
    sharded_submodules,
)
from minifabric.strategies.ft import FaultTolerance, build_fault_tolerance
from minifabric.strategies.ft.fsdp_gradients import FSDPGradients
from minifabric.strategies.rank_zero_init import keep_rank_zero_tensors
from minifabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from minifabric.strategies.ft.replica_group import ReplicaGroup

log = logging.getLogger(__name__)
StateDictStr = Literal["sharded", "full"]
SHARDING_STRATEGIES: tuple[str, ...] = get_args(ShardingStr)
STATE_DICT_TYPES: tuple[str, ...] = get_args(StateDictStr)


class FSDPStrategy(Strategy):
    """Fully sharded data parallel on PyTorch FSDP2 (``fully_shard``, DTensor, DeviceMesh).

    ``setup`` shards each repeated block of the model, then the root. A model built in
    ``acc.init_module(empty_init=True)`` is materialized after sharding, so no rank ever holds the
    full model; its initial weights equal single-process init with the same seed.

    Args:
        auto_wrap_policy: which submodules become their own sharding unit. ``None``: every child
            class that repeats under one parent (e.g. the transformer blocks); a set of module
            classes; or a callable ``(module, name) -> bool``.
        activation_checkpointing_policy: module classes whose activations are recomputed in backward.
        sharding_strategy: ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"`` (parameters stay gathered
            from forward to backward), ``"NO_SHARD"`` (replicated, like DDP) or ``"HYBRID_SHARD"``
            (replicated across nodes, sharded within each node).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory and step
            the optimizer there. On a CPU-only run this changes nothing: everything is in CPU memory.
        state_dict_type: how checkpoints are written: ``"sharded"`` (each rank writes its shard) or
            ``"full"`` (one file from rank 0).
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` that replaces the one
            derived from the Accelerator's ``precision``; its ``output_dtype`` applies to the root only.
        timeout: collective timeout (``timedelta`` or seconds).
        device_mesh: with ``sharding_strategy="HYBRID_SHARD"``, ``(replicas, shards)``: parameters
            are sharded over groups of ``shards`` consecutive ranks and replicated ``replicas``
            times (default: ``(num_nodes, devices per node)``). A torch ``DeviceMesh`` is used as
            it is (2-D ``(replicate, shard)`` for HSDP, 1-D otherwise).
        process_group_backend: override the backend (default: nccl on CUDA, gloo on CPU).
        compile: ``True`` or ``torch.compile`` keyword arguments: compile each sharding unit (the
            blocks auto-wrap finds) on its own before ``fully_shard``, so FSDP's hooks run around
            every compiled block. A whole-model ``torch.compile(model)`` is re-applied that way.
        **fabric_options: Lightning Fabric's FSDP1 options, read as their FSDP2 meaning
            (:mod:`~minifabric.strategies.fsdp_options`): ``sync_module_states=True`` broadcasts rank
            0's weights before sharding; ``activation_checkpointing`` adds to the policy;
            ``limit_all_gathers``, ``use_orig_params``, ``forward_prefetch``, ``backward_prefetch``,
            ``device_id`` are accepted with one warning (FSDP2 has no such knob). ``CPUOffload``,
            FSDP1 ``MixedPrecision``, ``ShardingStrategy`` and ``ModuleWrapPolicy`` values are accepted too.
        fault_tolerance: a :class:`~minifabric.FaultTolerance`: this run is one replica group of a
            fault-tolerant job (torchft). The model is sharded inside the group and replicated across
            groups; the job keeps training when a group dies, and a group that comes back copies the
            state from a live one. ``acc.strategy.replica_group`` then tells the committed step.

    Example:
        >>> from minifabric import Accelerator, FSDPStrategy
        >>> strategy = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", state_dict_type="full")
        >>> acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2)
    """

    def __init__(
        self,
        *,
        auto_wrap_policy: WrapPolicy = None,
        activation_checkpointing_policy: set[type[nn.Module]] | None = None,
        sharding_strategy: ShardingStr = "FULL_SHARD",
        cpu_offload: bool = False,
        state_dict_type: StateDictStr = "sharded",
        mixed_precision: MixedPrecisionPolicy | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        compile: CompileOption = False,
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        fault_tolerance: FaultTolerance | None = None,
        **fabric_options: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend, compile=compile)
        self._ft_started = False
        self.fault_tolerance = fault_tolerance  # builds the component `self.ft`
        options = translate_fabric_options(
            {
                "auto_wrap_policy": auto_wrap_policy,
                "activation_checkpointing_policy": activation_checkpointing_policy,
                "sharding_strategy": sharding_strategy,
                "cpu_offload": cpu_offload,
                "mixed_precision": mixed_precision,
            },
            fabric_options,
        )
        auto_wrap_policy = options["auto_wrap_policy"]
        activation_checkpointing_policy = options["activation_checkpointing_policy"]
        sharding_strategy, cpu_offload = options["sharding_strategy"], options["cpu_offload"]
        mixed_precision = options["mixed_precision"]
        _check_options(
            auto_wrap_policy,
            activation_checkpointing_policy,
            sharding_strategy,
            cpu_offload,
            state_dict_type,
            mixed_precision,
        )
        self.sync_module_states: bool = options["sync_module_states"]
        self.auto_wrap_policy = auto_wrap_policy
        self.activation_checkpointing_policy = set(activation_checkpointing_policy or ())
        self.sharding_strategy = sharding_strategy
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self.mixed_precision = mixed_precision
        self.device_mesh = check_device_mesh(device_mesh, sharding_strategy)
        self._mesh: DeviceMesh | None = device_mesh if isinstance(device_mesh, DeviceMesh) else None

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """The replica-group settings; set before ``acc.launch()``, the component :attr:`ft` follows them."""
        return self._fault_tolerance

    @fault_tolerance.setter
    def fault_tolerance(self, value: FaultTolerance | None) -> None:
        if self._ft_started:
            raise RuntimeError(
                f"fault_tolerance cannot change once the run started (acc.launch()), got {value!r}: pass"
                " it before, `FSDPStrategy(fault_tolerance=FaultTolerance(...))`."
            )
        #: fault tolerance as one component (its hooks do nothing without ``fault_tolerance``)
        self.ft = build_fault_tolerance(value, FSDPGradients())
        self._fault_tolerance = value

    @property
    def replica_group(self) -> ReplicaGroup | None:
        """This process's replica group when ``fault_tolerance`` is set (after ``acc.launch()``), else None."""
        return self.ft.replica_group

    def _check_world(self) -> None:
        """Raise if ``device_mesh`` does not fit the world."""
        check_mesh_size(self.device_mesh, self.num_nodes * self.num_processes)

    # ---- the world ---------------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()  # fully_shard needs a process group even with one process
        self._ft_started = True
        self.ft.on_setup(self)

    def teardown(self) -> None:
        self.ft.teardown()
        super().teardown()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Each rank reads its own part of the data; with replica groups, a part of the whole job's."""
        return self.ft.sampler_kwargs(super().distributed_sampler_kwargs)

    @property
    def writes_checkpoints(self) -> bool:
        """With replica groups, one live group writes (the others hold the same state)."""
        return self.ft.writes_checkpoints

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh parameters are sharded over (built on first use, after ``launch``)."""
        if self._mesh is None:
            self._mesh = mesh_after_launch(
                lambda: build_mesh(
                    self.sharding_strategy,
                    self.root_device.type,
                    self.num_nodes,
                    self.num_processes,
                    shape=self.device_mesh if isinstance(self.device_mesh, tuple) else None,
                ),
                "The FSDP device mesh",
                "`acc.init_module()` or `acc.setup(model)`",
            )
        return self._mesh

    # ---- sharding ----------------------------------------------------------------------------

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The root's mixed precision policy: ``mixed_precision`` if given, else from ``precision``."""
        return self.mixed_precision or mixed_precision_policy(self.precision)

    @property
    def _offload(self) -> OffloadPolicy:
        return offload_policy(self.cpu_offload, self.root_device.type)

    @property
    def _reshard_after_forward(self) -> bool:
        return self.sharding_strategy != "SHARD_GRAD_OP"

    def _shard_settings(self, mp_policy: MixedPrecisionPolicy) -> ShardSettings:
        """The ``fully_shard`` arguments of this strategy, with ``mp_policy``."""
        return ShardSettings(self.mesh, self._reshard_after_forward, mp_policy, self._offload)

    @property
    def parameter_device(self) -> torch.device:
        """With CPU offload FSDP keeps the sharded parameters in CPU memory; else the device."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def meta_init_part(self) -> tuple[int, int] | None:
        """Dim 0 over all ranks (``FULL_SHARD``, ``SHARD_GRAD_OP``) or over the mesh's last dim
        (``HYBRID_SHARD``; ``setup`` checks each placement before it uses what was kept)."""
        if self.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            return self.world_size, self.global_rank
        if self.sharding_strategy != "HYBRID_SHARD":
            return None
        if self._mesh is not None:
            return self._mesh.size(1), self._mesh.get_local_rank(1)
        shards = self.device_mesh[1] if isinstance(self.device_mesh, tuple) else self.num_processes
        return shards, self.global_rank % shards

    def wrap(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` now as its own unit (manual wrapping inside ``acc.init_module()``)."""
        if isinstance(module, FSDPModule):
            return module
        if self.world_size > 1 and not all(t.is_meta for t in (*module.parameters(), *module.buffers())):
            # an eager block is sharded now: compare it with rank 0's construction now (per-rank seeds)
            keep_rank_zero_tensors(module, self.root_device)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        with keeping_init_records(module):  # init written after `wrap` in __init__ is recorded too
            return shard_module(module, self._shard_settings(inner_policy(self.mp_policy)))

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (blocks, then root) and materialize it if it was built on meta."""
        module, compiler = self._compiler(module)
        places = self._recorded_places(module)  # raises before any collective if an init cannot be reproduced
        if self.world_size > 1 and not isinstance(module, FSDPModule):
            if self.sync_module_states and not places:
                broadcast_module_states(module, self.root_device)
            else:  # each rank keeps its slice: they must all be slices of rank 0's model, as under DDP
                keep_rank_zero_tensors(module, self.root_device)
        module = self.precision.convert_module(module)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        blocks = [] if isinstance(module, FSDPModule) else self._blocks(module)
        if compiler is not None:
            compile_modules(blocks or sharded_submodules(module) or [module], compiler)
        if not isinstance(module, FSDPModule):
            shard_model(module, blocks, self._shard_settings(self.mp_policy))
        if places:
            self._materialize(module, places, self.parameter_device, self.root_device)
        self.ft.on_module(module)
        return module

    def _compiler(self, module: nn.Module) -> tuple[nn.Module, Compiler | None]:
        """The module to shard and how to compile its units (see :mod:`~minifabric.strategies.compile`)."""
        unwrapped, compiler = super()._compiler(module)
        if unwrapped is not module:
            log.info(
                "FSDP: torch.compile(model) was unwrapped; each sharding unit of %s is compiled on its"
                " own before fully_shard instead, so FSDP's hooks run around the compiled blocks",
                type(unwrapped).__name__,
            )
        return unwrapped, compiler

    def _blocks(self, module: nn.Module) -> list[nn.Module]:
        if not sharded_submodules(module):
            return select_blocks(module, self.auto_wrap_policy)
        if self.auto_wrap_policy is not None:
            warnings.warn(
                f"{type(module).__name__} already has sharded submodules (from `wrap` or `fully_shard`),"
                " so `auto_wrap_policy` is ignored and only the root is sharded. Drop one of the two:"
                " `FSDPStrategy()` with manual wrapping, or the policy without it.",
                stacklevel=3,
            )
        return []

    # ---- the step ----------------------------------------------------------------------------

    @property
    def requires_backward_call(self) -> bool:
        """Always, as Fabric's FSDP strategy (its precision plugin runs the backward)."""
        return True

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refuse an optimizer over parameters no set-up model owns; with replica groups, watch it."""
        self.ft.on_optimizer(optimizer)
        check_sharded_parameters(optimizer)
        return optimizer

    def setup_dataloader(self, dataloader: Any) -> None:
        """With replica groups, a group that heals also takes the live group's position in the data."""
        self.ft.on_dataloader(dataloader)

    def setup_scheduler(self, scheduler: Any) -> None:
        """With replica groups, a group that heals also takes the live group's scheduler state."""
        self.ft.on_scheduler(scheduler)

    def forward_context(self) -> ContextManager:
        self.ft.before_forward()  # before FSDP gathers anything: a heal writes the shards
        # With a casting policy FSDP2 already runs forward in the low-precision dtype; autocast on
        # top would only add casts. (Decided without building the policy: this runs every forward.)
        casts = (
            self.mixed_precision.param_dtype is not None
            if self.mixed_precision is not None
            else self.precision.is_mixed
        )
        if casts:
            return nullcontext()
        return self.precision.forward_context()

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step, unless this replica group's step failed (then every rank of the group drops it).

        With replica groups this is where the group's ranks agree to commit (torchft's
        ``should_commit``, a round trip to the group's manager): the one communication of the step
        outside forward and backward.

        Raises:
            RuntimeError: with replica groups, a ``closure`` (its forward and backward would run after
                the commit: a failure in them could not drop the step).
        """
        return self.ft.optimizer_step(optimizer, kwargs, partial(super().optimizer_step, optimizer, **kwargs))

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Inside, gradients accumulate unreduced (FSDP2's ``set_requires_gradient_sync(False)``)."""
        if not enabled or not isinstance(module, FSDPModule):
            return nullcontext()
        return without_gradient_sync(module)

    #: the norm over all shards, a plain tensor equal on every rank (see `Strategy.clip_gradients_norm`)
    _clip_grad_norm = staticmethod(clip_grad_norm_)


@contextmanager
def without_gradient_sync(module: FSDPModule) -> Generator[None, None, None]:
    """Gradients accumulate unreduced inside (no reduce-scatter, no cross-replica all-reduce)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _check_options(
    auto_wrap_policy: Any,
    activation_checkpointing_policy: Any,
    sharding_strategy: Any,
    cpu_offload: Any,
    state_dict_type: Any,
    mixed_precision: Any,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad option and showing a valid one."""
    if sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(
            f"Unknown sharding_strategy={sharding_strategy!r}. Choose one of"
            f' {", ".join(map(repr, SHARDING_STRATEGIES))}, e.g. `FSDPStrategy(sharding_strategy="FULL_SHARD")`.'
        )
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(
            f'Unknown state_dict_type={state_dict_type!r}. Choose "sharded" or "full", e.g.'
            ' `FSDPStrategy(state_dict_type="full")`.'
        )
    if not isinstance(cpu_offload, bool):
        raise TypeError(
            f"cpu_offload must be True or False, got {cpu_offload!r}: `FSDPStrategy(cpu_offload=True)`."
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mixed_precision!r}:"
            " `FSDPStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`, or set"
            ' `Accelerator(precision="bf16-mixed")`.'
        )
    if (
        auto_wrap_policy is not None
        and not callable(auto_wrap_policy)
        and not _is_class_set(auto_wrap_policy)
    ):
        raise TypeError(
            f"auto_wrap_policy must be None, a set of nn.Module classes or a callable (module, name) -> bool,"
            f" got {auto_wrap_policy!r}, e.g. `FSDPStrategy(auto_wrap_policy={{Block}})`."
        )
    if activation_checkpointing_policy is not None and not _is_class_set(activation_checkpointing_policy):
        raise TypeError(
            "activation_checkpointing_policy must be a set of nn.Module classes, got"
            f" {activation_checkpointing_policy!r}, e.g. `FSDPStrategy(activation_checkpointing_policy={{Block}})`."
        )


def _is_class_set(value: Any) -> bool:
    return isinstance(value, (set, frozenset)) and all(
        isinstance(cls, type) and issubclass(cls, nn.Module) for cls in value
    )
