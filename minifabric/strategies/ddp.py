"""Data parallel: every rank holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from minifabric.runtime.environment import DEFAULT_TIMEOUT, default_backend
from minifabric.strategies.compile import CompileOption
from minifabric.strategies.strategy import Strategy


class DDPStrategy(Strategy):
    """Distributed data parallel over torch's ``DistributedDataParallel``.

    Args:
        comm_hook: a DDP communication hook, e.g.
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``
            or ``powerSGD_hook.powerSGD_hook``.
        comm_state: the hook's state (``PowerSGDState``, ``PostLocalSGDState``, ...).
        comm_wrapper: wraps the hook, e.g. ``default_hooks.bf16_compress_wrapper``.
        model_averaging_period: with a ``PostLocalSGDState`` and ``post_localSGD_hook``, average the
            parameters across ranks every this many optimizer steps (post-local SGD).
        zero_redundancy: shard optimizer state across ranks with ``ZeroRedundancyOptimizer`` (ZeRO-1).
        timeout: collective timeout. process_group_backend: override gloo/nccl.
        compile: ``True`` or ``torch.compile`` keyword arguments: compile the DDP-wrapped model (DDP
            splits the graph at its gradient buckets); see :class:`~minifabric.Strategy`.
        start_method: Lightning Fabric's: ``"popen"`` (default) re-runs the script per process at
            ``acc.launch()``; ``"spawn"`` and ``"forkserver"`` start processes that run a function,
            ``acc.launch(train)`` (``launch()`` without one raises, as in Fabric). ``"fork"`` is refused:
            processes are spawned, not forked.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``static_graph``,
            ``gradient_as_bucket_view``, ``find_unused_parameters``, ``bucket_cap_mb``, ...);
            a name it does not take raises here.

    Example:
        >>> from minifabric import Accelerator, DDPStrategy
        >>> acc = Accelerator(strategy=DDPStrategy(static_graph=True, zero_redundancy=True))
    """

    def __init__(
        self,
        *,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        zero_redundancy: bool = False,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        compile: CompileOption = False,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(timeout=timeout, process_group_backend=process_group_backend, compile=compile)
        self.spawn_only = _spawn_only(start_method)
        _check_ddp_kwargs(ddp_kwargs)
        if comm_hook is None and (comm_state is not None or comm_wrapper is not None):
            raise ValueError(
                "DDPStrategy got `comm_state`/`comm_wrapper` without `comm_hook`. Pass the hook too, e.g."
                " `DDPStrategy(comm_hook=powerSGD_hook.powerSGD_hook, comm_state=PowerSGDState(None))`."
            )
        if model_averaging_period is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

            if not isinstance(comm_state, PostLocalSGDState):
                raise ValueError(
                    f"model_averaging_period={model_averaging_period!r} is for post-local SGD and needs"
                    " `comm_state=PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=N)`"
                    " with `comm_hook=post_localSGD_hook.post_localSGD_hook`."
                )
            if model_averaging_period < 1:
                raise ValueError(f"model_averaging_period must be >= 1, got {model_averaging_period!r}.")
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        self.comm_wrapper = comm_wrapper
        self.model_averaging_period = model_averaging_period
        self.zero_redundancy = zero_redundancy
        self.ddp_kwargs = ddp_kwargs

    def _place_module(self, module: nn.Module) -> nn.Module:
        module = super()._place_module(module)
        if self.world_size == 1:
            return module
        self._check_comm_hook_backend()
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook is not None:
            _give_post_local_sgd_a_subgroup(self.comm_state, self.num_processes)
            hook = self.comm_wrapper(self.comm_hook) if self.comm_wrapper is not None else self.comm_hook
            ddp.register_comm_hook(state=self.comm_state, hook=hook)
        return ddp

    def _check_comm_hook_backend(self) -> None:
        """bf16 compression needs NCCL; say so at setup instead of in the first backward."""
        names = {getattr(self.comm_hook, "__name__", ""), getattr(self.comm_wrapper, "__name__", "")}
        bf16 = sorted(names & _BF16_HOOKS)
        backend = self.process_group_backend or default_backend(self.root_device)
        if bf16 and backend != "nccl":
            raise ValueError(
                f"DDPStrategy was given {bf16[0]}, which compresses gradients to bfloat16: torch supports"
                f" that only on CUDA with NCCL, but this run uses the {backend!r} backend. On"
                " CPU use `DDPStrategy(comm_hook=default_hooks.fp16_compress_hook)` or"
                " `comm_wrapper=default_hooks.fp16_compress_wrapper`."
            )

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.zero_redundancy and self.world_size > 1:
            optimizer = _zero_redundancy(optimizer)
        if self.model_averaging_period is not None:
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
            from torch.distributed.optim import PostLocalSGDOptimizer

            averager = PeriodicModelAverager(
                period=self.model_averaging_period, warmup_steps=self.comm_state.start_localSGD_iter
            )
            optimizer = PostLocalSGDOptimizer(optimizer, averager)
        return optimizer

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return nullcontext()


def _spawn_only(start_method: Any) -> bool:
    """Whether Fabric's ``start_method`` means ``launch`` must be given a function."""
    if start_method in ("spawn", "forkserver"):
        return True
    if start_method == "popen":
        return False
    fix = ' Use `DDPStrategy(start_method="spawn")` with `acc.launch(train)`, or the default "popen".'
    if start_method == "fork":
        raise ValueError(
            'DDPStrategy(start_method="fork"): minifabric spawns processes, it does not fork them'
            " (a forked rank inherits threads and CUDA state it cannot use)." + fix
        )
    raise ValueError(f"Unknown start_method={start_method!r}.{fix}")


def _check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
    """Refuse, at construction, a keyword argument that ``DistributedDataParallel`` does not take."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    unknown = sorted(set(ddp_kwargs) - accepted - {"device_ids"})
    if unknown or "device_ids" in ddp_kwargs:
        names = ", ".join(map(repr, unknown or ["device_ids"]))
        raise TypeError(
            f"DDPStrategy got keyword arguments that DistributedDataParallel does not take here: {names}."
            " DDPStrategy passes on DDP's own options (e.g. `DDPStrategy(static_graph=True,"
            " find_unused_parameters=True)`); the device comes from `Accelerator(devices=...)`."
        )


_BF16_HOOKS = frozenset({"bf16_compress_hook", "bf16_compress_wrapper", "bf16_compress_wrapper_hook"})


def _give_post_local_sgd_a_subgroup(comm_state: Any, processes_per_node: int) -> None:
    """Create post-local SGD's per-node subgroup now, on every rank.

    ``PostLocalSGDState(subgroup=None)`` would create it lazily in the first backward with
    ``dist.new_subgroups()``, whose default size is the number of CUDA devices: on CPU that fails.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    if isinstance(comm_state, PostLocalSGDState) and comm_state.subgroup is None:
        comm_state.subgroup, _ = dist.new_subgroups(group_size=processes_per_node)


def _zero_redundancy(optimizer: Optimizer) -> Optimizer:
    """Rebuild ``optimizer`` as a ZeRO-1 optimizer with the same class, groups and hyper-parameters.

    Only the defaults that the optimizer's constructor accepts are passed on: some defaults are
    derived (``AdamW`` records ``decoupled_weight_decay`` but does not take it). The groups keep
    every hyper-parameter they had.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
