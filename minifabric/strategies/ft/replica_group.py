"""This process's replica group in a fault-tolerant job: torchft's ``Manager`` behind the strategy.

:class:`ReplicaGroup` is what ``acc.strategy.replica_group`` returns: it watches what a group that
rejoins must copy (models, optimizers, loaders, the precision, registered objects), starts each step
(:mod:`~minifabric.strategies.ft.quorum`), averages gradients across groups, commits the step and
heals (:mod:`~minifabric.strategies.ft.heal`). The order of one step is told in
:mod:`minifabric.strategies.ft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric._torch import at_backward_end, register_global_step_pre_hook
from minifabric.strategies.ft import quorum
from minifabric.strategies.ft.config import FaultTolerance
from minifabric.strategies.ft.heal import (
    GroupSettings,
    PrecisionState,
    apply_heal_payload,
    heal_payload,
    module_state,
)
from minifabric.strategies.ft.watch import (
    check_optimizer_parameters,
    check_step_is_watched,
    loader_is_positioned,
)

if TYPE_CHECKING:
    from minifabric.strategies.ft.component import GradientHooks


class ReplicaGroup:
    """This process's replica group: quorum, gradient averaging across groups, commit and healing.

    Created by the strategy when the run starts (``acc.launch()``) and available as
    ``acc.strategy.replica_group``.

    Args:
        settings: the :class:`~minifabric.FaultTolerance` settings.
        group_rank: this process's rank inside its group.
        group_size: the number of processes in the group.
        store_address: ``(host, port)`` of the group's own key-value store (its ``MASTER_ADDR`` and
            ``MASTER_PORT``), where the group's ranks find their manager.
        gradients: how the strategy hands this group its gradients in backward (e.g.
            :class:`~minifabric.strategies.ft.fsdp_gradients.FSDPGradients`).
    """

    def __init__(
        self,
        settings: FaultTolerance,
        *,
        group_rank: int,
        group_size: int,
        store_address: tuple[str, int],
        gradients: GradientHooks,
    ) -> None:
        self.settings = settings
        self._gradients = gradients
        self.group_rank = group_rank
        self.group_size = group_size
        self.healed_at: list[int] = []  # the steps at which this group copied a live group's state
        self._modules: list[nn.Module] = []
        self._optimizers: list[Optimizer] = []
        self._objects: dict[str, Any] = {}
        self._in_step = False
        self._quorum_made = False
        self._decision: bool | None = None  # the last step's commit, shared by its optimizers
        self._pending: list[Any] = []  # this backward's cross-group all-reduces still running
        self._module_views: list[dict[str, torch.Tensor]] = []  # the modules' tensors, for a heal
        self._step_hook: Any = None  # refuses an optimizer of the watched models that was not set up
        self._manager = quorum.make_manager(self, store_address)
        self.register("minifabric.replica_groups", GroupSettings(settings))

    # ---- what this group holds and heals -----------------------------------------------------

    def watch_module(self, module: nn.Module) -> None:
        """Average ``module``'s gradients across groups in backward, and heal its weights.

        Raises:
            RuntimeError: the strategy finds no gradients of ``module`` to hand over (e.g. FSDP: no
                sharding unit), so nothing would be averaged.
        """
        self._gradients.attach(module, self._average_across_groups)
        self._modules.append(module)
        if self._step_hook is None:
            self._step_hook = register_global_step_pre_hook(self._refuse_unwatched_step)

    def _refuse_unwatched_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Before any optimizer's step: one that was not set up must not step a watched model."""
        check_step_is_watched(optimizer, self._modules, self._optimizers)

    def watch_optimizer(self, optimizer: Optimizer) -> None:
        """Heal ``optimizer``'s state (moments, step counts, learning rates) from a live group.

        Raises:
            ValueError: ``optimizer`` holds parameters of no model set up with ``fault_tolerance``
                (their gradients would never be averaged across groups, nor their values healed).
        """
        check_optimizer_parameters(optimizer, self._modules)
        self._optimizers.append(optimizer)

    def watch_dataloader(self, dataloader: Any) -> None:
        """Start each step before ``dataloader`` draws its batch, and heal its position too.

        Every loader ``acc.setup_dataloaders`` returns is watched. Drawing a batch joins the step's
        quorum first (:meth:`begin_step`), so a group that rejoins heals before it draws, and then
        reads on from where the live groups are in the epoch (its part of it); with
        ``min_replica_groups`` a group that waits for the others has drawn nothing yet. With
        ``overlap_quorum=True`` (and ``min_replica_groups=1``) the step starts at the forward
        instead, so the quorum runs while the live groups draw and compute: the batch a rejoining
        group draws before it heals is not used (its gradient of that step does not count), and
        the position it takes is the live groups' after their batch. A loader whose position cannot
        be saved (over an ``IterableDataset``) is not healed: such a group reads its data from
        where its script starts it.

        Raises:
            ValueError: ``dataloader`` reads a map-style dataset through a sampler of the user's own
                (``use_distributed_sampler=False``): a group that rejoins mid-epoch could not take
                the live groups' position.
        """
        positioned = loader_is_positioned(dataloader)
        if not self.settings.overlap_quorum or self.settings.min_replica_groups > 1:
            dataloader.call_before_each_batch(self.begin_step)
        if not positioned:
            return
        self.register(
            f"minifabric.dataloader{sum(k.startswith('minifabric.dataloader') for k in self._objects)}",
            dataloader,
        )

    def watch_precision(self, precision: Any) -> None:
        """Heal the precision's state (the loss scale of ``"16-mixed"``); refuse another precision.

        A group with another precision would average its gradients, scaled or not, with theirs.
        """
        self.register("minifabric.precision", PrecisionState(precision))

    def watch_scheduler(self, scheduler: Any) -> None:
        """Heal ``scheduler``'s state too (the one given to ``acc.setup(..., scheduler=)``).

        Raises:
            TypeError: ``scheduler`` has no ``state_dict()``/``load_state_dict()``.
        """
        count = sum(k.startswith("minifabric.scheduler") for k in self._objects)
        try:
            self.register(f"minifabric.scheduler{count}", scheduler)
        except TypeError as err:
            raise TypeError(
                f"The scheduler given to `acc.setup(..., scheduler=)` ({type(scheduler).__name__}) has no"
                " state_dict()/load_state_dict(), so a replica group that rejoins could not copy it and"
                " would step with another learning rate. Pass a torch LR scheduler, or give yours"
                " state_dict() and load_state_dict()."
            ) from err

    def register(self, name: str, obj: Any) -> None:
        """Also heal ``obj`` (anything with ``state_dict()``/``load_state_dict()``, e.g. an LR scheduler).

        Models, optimizers and data loaders set up by the Accelerator are healed already; register
        what else must equal the live groups' after a rejoin.

        Example:
            >>> acc.strategy.replica_group.register("scheduler", scheduler)  # doctest: +SKIP
        """
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"register({name!r}, ...) needs an object with state_dict() and load_state_dict(), got"
                f" {type(obj).__name__}."
            )
        if name in self._objects:
            raise ValueError(f"{name!r} is registered already; use another name.")
        self._objects[name] = obj

    # ---- the step ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Join this step's quorum (once per step); heal first if this group is behind.

        Called before a watched loader draws the step's batch, else before the first forward. With
        ``min_replica_groups`` above 1 it returns only once that many groups take part, asking
        again until then (nothing is drawn or computed meanwhile).

        Raises:
            RuntimeError: fewer than ``min_replica_groups`` groups took part for ``quorum_timeout``.
        """
        if self._in_step:
            return
        self._decision = None
        # what a live group sends to one that heals: the sharded tensors, taken here while FSDP has
        # them in the module (during the forward it swaps in the unsharded ones); read in place
        self._module_views = [module_state(m) for m in self._modules]
        quorum.join_quorum(self._manager, self.settings)
        if self.settings.min_replica_groups > 1:
            quorum.wait_for_enough_groups(self._manager, self.settings, self.group_rank)
        self._in_step = self._quorum_made = True

    def commit(self) -> bool:
        """Whether this step may be applied: every rank of the group agrees (the only collective here).

        Several optimizers stepped in one step share the first one's decision.

        Raises:
            RuntimeError: no forward through the set-up model ran before the first ``optimizer.step()``.
        """
        if self._in_step:
            self._in_step = False
            self._finish_all_reduces()  # none left, unless backward ran outside the autograd engine
            self._decision = bool(self._manager.should_commit())
        elif self._decision is None:
            raise RuntimeError(
                "optimizer.step() was called before any forward through the set-up model, so this"
                " replica group never joined a step. Run the forward through what `acc.setup` returned."
            )
        return self._decision

    def _average_across_groups(self, params: list[nn.Parameter], shard: torch.Tensor) -> None:
        """Average ``shard``, a gradient buffer of ``params`` (FSDP2: one unit's flat reduce-scattered
        gradient), with the other live groups' (the gradient hook the strategy calls)."""
        if not self._in_step:
            raise RuntimeError(
                "Gradients were reduced outside a step this replica group joined: run the forward"
                " through what `acc.setup` returned."
            )
        from torch.distributed import ReduceOp

        # A failure (a group died mid-step) is recorded by the manager and makes `commit` False.
        work = self._manager.allreduce(shard, reduce_op=ReduceOp.AVG)
        in_backward = at_backward_end(self._finish_all_reduces)  # the first one run waits for all
        if not in_backward or not self._gradients.defers(shard, params):
            # the strategy reads `shard` right after this hook returns, or (outside an autograd
            # backward pass) nothing would wait for it later
            work.wait()
            return
        self._pending.append(work)

    def _finish_all_reduces(self) -> None:
        """Wait for this backward's cross-group all-reduces (each divides by the participants).

        Then apply a heal still pending: with ``overlap_quorum`` torchft would apply the state of a
        group that was behind in ``should_commit``, after a clip had unscaled the gradients with
        this group's old loss scale. When backward ends, nothing has read them yet.
        """
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()
        quorum.heal_now(self._manager)

    # ---- what the loop reads -----------------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps: the same in every live group (a group that rejoins takes the live count)."""
        return int(self._manager.current_step())

    @property
    def contributed(self) -> bool:
        """Whether this group's gradient went into the current (or last) step.

        False only with ``overlap_quorum=True`` at the step where this group caught up with the live
        groups (it copied their state; its own gradient of that step was not used).
        """
        return bool(self._manager.is_participating())

    @property
    def num_participants(self) -> int:
        """How many groups took part in the current (or last) step."""
        return int(self._manager.num_participants())

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes checkpoints: the first live group of the last quorum.

        Before the first step, group 0 does.
        """
        if not self._quorum_made:
            return self.settings.replica_group_id == 0
        return self._manager.participating_rank() == 0

    def state_dict(self) -> dict[str, Any]:
        """The committed step count, for a checkpoint (``acc.save(..., {"replicas": replica_group})``)."""
        return dict(self._manager.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the committed step count from a checkpoint."""
        self._manager.load_state_dict(state)

    def shutdown(self) -> None:
        """Stop the manager's servers (its lighthouse client and the state server)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._manager.shutdown(wait=False)

    # ---- healing (called by torchft) -----------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        # Called on torchft's quorum thread: while the main thread waits for the quorum, or runs the
        # forward (overlap_quorum). Parameters and optimizer state change only in optimizer.step(),
        # after the quorum and after the commit has stopped serving this state, so they are read in
        # place; the module's tensors come from the step's start (see `begin_step`).
        return heal_payload(self._module_views, self._optimizers, self._objects)

    def _load(self, state: dict[str, Any]) -> None:
        apply_heal_payload(state, self._modules, self._optimizers, self._objects)
        self.healed_at.append(self.step)
