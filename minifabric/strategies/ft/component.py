"""Fault tolerance as one component a strategy calls at fixed points, whether it is on or off.

:class:`ReplicaGroupComponent` names the hooks; :func:`build_fault_tolerance` turns the strategy's
``fault_tolerance=`` setting into :class:`NoFaultTolerance` (``None``: every hook does nothing) or
:class:`TorchFTFaultTolerance` (replica groups on torchft). The strategy calls every hook
unconditionally. The component reads only what every :class:`~minifabric.strategies.strategy.Strategy`
has (ranks, environment, precision); what is particular to a strategy's gradients comes in as
:class:`GradientHooks`. Nothing here imports torchft or torch's FSDP.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric._torch import forget_unscale
from minifabric.strategies.ft.config import FaultTolerance

if TYPE_CHECKING:
    from minifabric.strategies.ft.replica_group import ReplicaGroup
    from minifabric.strategies.strategy import Strategy


class GradientHooks(Protocol):
    """How a strategy hands a replica group its gradients in backward (FSDP2: ``FSDPGradients``)."""

    def attach(self, module: nn.Module, average: Callable[[list[nn.Parameter], torch.Tensor], None]) -> None:
        """Call ``average(params, buffer)`` in backward with each gradient buffer of ``module``."""

    def defers(self, buffer: torch.Tensor, params: list[nn.Parameter]) -> bool:
        """Whether the strategy leaves ``buffer`` unread after the hook, so its all-reduce may end later."""


class ReplicaGroupComponent(abc.ABC):
    """The hooks a strategy calls for fault tolerance, in the order of a run.

    ``enabled`` tells whether this run is one replica group of a fault-tolerant job.
    """

    enabled: bool = False

    @property
    @abc.abstractmethod
    def replica_group(self) -> ReplicaGroup | None:
        """This process's replica group (``acc.strategy.replica_group``), once set up; else ``None``."""

    @abc.abstractmethod
    def sampler_kwargs(self, kwargs: dict[str, int]) -> dict[str, int]:
        """The data split: the strategy's ``{"num_replicas", "rank"}``, over the whole job's groups."""

    @abc.abstractmethod
    def on_setup(self, strategy: Strategy) -> None:
        """The run started (``acc.launch()``, after the strategy's process group exists)."""

    @abc.abstractmethod
    def on_module(self, module: nn.Module) -> None:
        """``module`` was set up (sharded, materialized): its gradients and weights are watched."""

    @abc.abstractmethod
    def on_optimizer(self, optimizer: Optimizer) -> None:
        """``optimizer`` was set up."""

    @abc.abstractmethod
    def on_dataloader(self, dataloader: Any) -> None:
        """``dataloader`` was set up (``acc.setup_dataloaders``)."""

    @abc.abstractmethod
    def on_scheduler(self, scheduler: Any) -> None:
        """``scheduler`` was given to ``acc.setup(..., scheduler=)``."""

    @abc.abstractmethod
    def before_forward(self) -> None:
        """A forward through a set-up model is about to run (before the strategy gathers anything)."""

    @abc.abstractmethod
    def optimizer_step(self, optimizer: Optimizer, kwargs: dict[str, Any], step: Callable[[], Any]) -> Any:
        """Run ``step`` (the strategy's optimizer step with ``kwargs``) if the step commits; return its result."""

    @property
    @abc.abstractmethod
    def writes_checkpoints(self) -> bool:
        """Whether this process's run writes checkpoints."""

    @abc.abstractmethod
    def teardown(self) -> None:
        """The run ends."""


class NoFaultTolerance(ReplicaGroupComponent):
    """Fault tolerance off: every hook leaves everything as it is; every step commits."""

    enabled = False

    @property
    def replica_group(self) -> None:
        """None: this run is not a replica group."""
        return None

    def sampler_kwargs(self, kwargs: dict[str, int]) -> dict[str, int]:
        """``kwargs`` as they are."""
        return kwargs

    def on_setup(self, strategy: Strategy) -> None:
        """Nothing to start."""

    def on_module(self, module: nn.Module) -> None:
        """Nothing to watch."""

    def on_optimizer(self, optimizer: Optimizer) -> None:
        """Nothing to watch."""

    def on_dataloader(self, dataloader: Any) -> None:
        """Nothing to watch."""

    def on_scheduler(self, scheduler: Any) -> None:
        """Nothing to watch."""

    def before_forward(self) -> None:
        """No quorum to join."""

    def optimizer_step(self, optimizer: Optimizer, kwargs: dict[str, Any], step: Callable[[], Any]) -> Any:
        """``step()``: nothing to agree on."""
        return step()

    @property
    def writes_checkpoints(self) -> bool:
        """True: this run writes its checkpoints."""
        return True

    def teardown(self) -> None:
        """Nothing to stop."""


class TorchFTFaultTolerance(ReplicaGroupComponent):
    """This run is one replica group of a fault-tolerant job, on torchft.

    Its :class:`~minifabric.strategies.ft.replica_group.ReplicaGroup` is built by :meth:`on_setup`
    (torchft is imported then); until then every hook but :meth:`sampler_kwargs` does nothing.

    Args:
        config: the :class:`~minifabric.FaultTolerance` settings.
        gradients: how the strategy hands the group its gradients.
    """

    enabled = True

    def __init__(self, config: FaultTolerance, gradients: GradientHooks) -> None:
        self.config = config
        self.gradients = gradients
        self._group: ReplicaGroup | None = None
        self._precision: Any = None

    @property
    def replica_group(self) -> ReplicaGroup | None:
        """This process's replica group, after :meth:`on_setup`."""
        return self._group

    def sampler_kwargs(self, kwargs: dict[str, int]) -> dict[str, int]:
        """Each rank of each group reads its own part of the whole job's data."""
        size, rank = kwargs["num_replicas"], kwargs["rank"]
        return {
            "num_replicas": size * self.config.num_replica_groups,
            "rank": self.config.replica_group_id * size + rank,
        }

    def on_setup(self, strategy: Strategy) -> None:
        """Build this process's replica group (its torchft manager) and watch the precision."""
        from minifabric.strategies.ft.replica_group import ReplicaGroup

        self._group = ReplicaGroup(
            self.config,
            group_rank=strategy.global_rank,
            group_size=strategy.world_size,
            store_address=(strategy.environment.main_address, strategy.environment.main_port),
            gradients=self.gradients,
        )
        self._precision = strategy.precision
        # the gradient scaler's scale shapes every update: a rejoining group takes the live one's
        self._group.watch_precision(strategy.precision)

    def on_module(self, module: nn.Module) -> None:
        """Average ``module``'s gradients across groups, and heal its weights."""
        if self._group is not None:
            self._group.watch_module(module)

    def on_optimizer(self, optimizer: Optimizer) -> None:
        """Heal ``optimizer``'s state."""
        if self._group is not None:
            self._group.watch_optimizer(optimizer)

    def on_dataloader(self, dataloader: Any) -> None:
        """Start steps before ``dataloader`` draws; heal its position."""
        if self._group is not None:
            self._group.watch_dataloader(dataloader)

    def on_scheduler(self, scheduler: Any) -> None:
        """Heal ``scheduler``'s state."""
        if self._group is not None:
            self._group.watch_scheduler(scheduler)

    def before_forward(self) -> None:
        """Join the step's quorum if no loader did (a heal writes the weights before they are read)."""
        if self._group is not None:
            self._group.begin_step()

    def optimizer_step(self, optimizer: Optimizer, kwargs: dict[str, Any], step: Callable[[], Any]) -> Any:
        """Step only if every rank of the group agrees to commit; a dropped step returns ``None``.

        This agreement (torchft's ``should_commit``, a round trip to the group's manager) is the one
        communication of the step outside forward and backward.

        Raises:
            RuntimeError: a ``closure`` (its forward and backward would run after the commit: a
                failure in them could not drop the step).
        """
        group = self._group
        if group is not None and kwargs.get("closure") is not None:
            raise RuntimeError(
                f"optimizer.step(closure) is not supported with fault_tolerance: {type(optimizer).__name__}"
                " would run the closure's forward and backward after the replica groups agreed to commit"
                " the step, so a group dying during them could not drop it. Run the forward and"
                " `acc.backward(loss)` before `optimizer.step()`, with an optimizer that takes no closure."
            )
        if group is None or group.commit():
            return step()
        scaler = getattr(self._precision, "scaler", None)
        if scaler is not None:  # a clip may have unscaled the dropped step's gradients
            forget_unscale(scaler, optimizer)
        return None

    @property
    def writes_checkpoints(self) -> bool:
        """One live group writes (the others hold the same state); before the run starts, this one."""
        return self._group.writes_checkpoints if self._group is not None else True

    def teardown(self) -> None:
        """Stop the group's torchft manager."""
        if self._group is not None:
            self._group.shutdown()


def build_fault_tolerance(config: FaultTolerance | None, gradients: GradientHooks) -> ReplicaGroupComponent:
    """The component for a strategy's ``fault_tolerance=`` setting (``gradients``: the strategy's hooks).

    Raises:
        TypeError: ``config`` is neither ``None`` nor a :class:`~minifabric.FaultTolerance`.
    """
    if config is None:
        return NoFaultTolerance()
    if not isinstance(config, FaultTolerance):
        raise TypeError(
            f"fault_tolerance must be a minifabric.FaultTolerance, got {config!r}:"
            " `FSDPStrategy(fault_tolerance=FaultTolerance(replica_group_id=0, num_replica_groups=2))`."
        )
    return TorchFTFaultTolerance(config, gradients)
