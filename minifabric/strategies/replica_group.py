"""This process's replica group in a fault-tolerant job: torchft's ``Manager`` behind the strategy.

The strategy drives one step as torchft expects, without changing the user's loop:

1. before a loader set up by the Accelerator draws the step's batch (else before the step's first
   forward through the set-up model), :meth:`ReplicaGroup.begin_step` asks the lighthouse which
   groups take part (the *quorum*) and, if this group is behind (it was restarted), copies the state
   of a live group into this one before anything runs; with ``min_replica_groups`` it asks again
   until that many groups take part;
2. in backward, each sharding unit's reduce-scattered gradient (one flat buffer per unit, FSDP2's
   own bucket) is averaged with the same shard of the other live groups (FSDP2's all-reduce hook,
   over torchft's reconfigurable gloo group). The all-reduce is started and not waited for: it runs
   while backward goes on through the next units, and all of them are waited for once, when the
   backward pass ends (before ``backward()`` returns, so clipping and the optimizer read averaged
   gradients). Where FSDP would read the buffer right after the hook (a cast to another dtype, a
   division after the reduction, an addition into gradients left from an earlier backward) the
   unit's all-reduce is waited for at once instead;
3. ``optimizer.step()`` calls :meth:`ReplicaGroup.commit`: the ranks of this group agree whether
   the step went through everywhere (no collective failed, enough groups took part); only then does
   the optimizer step. A step that failed is dropped by every rank of the group (the loss scale of
   ``"16-mixed"`` stays as it was).

By default the quorum is synchronous (torchft's ``use_async_quorum=False``): a group that heals does
so before its forward and then contributes a real gradient to that same step, so training equals a
run without the failure from that step on. With ``FaultTolerance(overlap_quorum=True)`` the quorum
is torchft's asynchronous one: asked for in :meth:`ReplicaGroup.begin_step` and waited for by the
first cross-group all-reduce in backward, so the lighthouse round trip runs under the forward. A
group that is behind then heals when its backward ends (before a clip or the optimizer reads the
gradients) and contributes a zero gradient to that step (torchft counts only the groups at the
latest step). The first step of a process is the
exception: its quorum is waited for and a heal applied before the forward, as in the synchronous
mode, because at step 0 torchft would count the group that copies the initial weights as taking
part and halve the gradients; at a rejoin the group still counts as not taking part.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric import process
from minifabric._torch import at_backward_end, register_global_step_pre_hook
from minifabric.strategies.fault_tolerance import FaultTolerance
from minifabric.strategies.heal_state import (
    GroupSettings,
    PrecisionState,
    load_module_state,
    load_optimizer_state,
    module_state,
    optimizer_state,
)

log = logging.getLogger(__name__)

#: torchft's Rust core logs every quorum at INFO (several lines a step) unless RUST_LOG says otherwise
_RUST_LOG_VAR = "RUST_LOG"


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
    """

    def __init__(
        self, settings: FaultTolerance, *, group_rank: int, group_size: int, store_address: tuple[str, int]
    ) -> None:
        self.settings = settings
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
        self._manager = _make_manager(self, store_address)
        self.register("minifabric.replica_groups", GroupSettings(settings))

    # ---- what this group holds and heals -----------------------------------------------------

    def watch_module(self, module: nn.Module) -> None:
        """Average ``module``'s gradient shards across groups in backward, and heal its weights.

        Raises:
            RuntimeError: ``module`` has no FSDP2 sharding unit (nothing would be averaged).
        """
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise RuntimeError(
                f"{type(module).__name__} has no FSDP sharding unit, so its gradients would never be"
                " averaged across replica groups. Set it up with `FSDPStrategy(fault_tolerance=...)`."
            )
        for unit in units:
            unit.set_all_reduce_hook(partial(self._average_across_groups, _own_parameters(unit)))
        self._modules.append(module)
        if self._step_hook is None:
            self._step_hook = register_global_step_pre_hook(self._refuse_unwatched_step)

    def _refuse_unwatched_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Before any optimizer's step: one that was not set up must not step a watched model.

        Its step would never commit (so no later step would ask for a quorum, and a group that
        died or rejoined would go unnoticed) and its state would not be healed.
        """
        if any(optimizer is watched for watched in self._optimizers):
            return
        ours = {id(p) for module in self._modules for p in module.parameters()}
        if any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                f"This {type(optimizer).__name__} steps the parameters of a model set up with"
                " fault_tolerance, but it was not set up: its steps would not commit across replica"
                " groups nor be copied to a group that rejoins. Set it up before the loop:"
                " `optimizer = acc.setup_optimizers(optimizer)`."
            )

    def watch_optimizer(self, optimizer: Optimizer) -> None:
        """Heal ``optimizer``'s state (moments, step counts, learning rates) from a live group.

        Raises:
            ValueError: ``optimizer`` holds parameters of no model set up with ``fault_tolerance``
                (their gradients would never be averaged across groups, nor their values healed).
        """
        ours = {id(p) for module in self._modules for p in module.parameters()}
        foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in ours]
        if foreign:
            raise ValueError(
                f"{type(optimizer).__name__} holds {len(foreign)} parameter(s) of no model set up with"
                f" fault_tolerance (shapes: {', '.join(str(tuple(p.shape)) for p in foreign[:4])}): their"
                " gradients would not be averaged across replica groups, so the groups would drift"
                " apart. Set up every model the optimizer steps first: `model = acc.setup(model)`, then"
                " `optimizer = acc.setup_optimizers(optimizer)` (or `acc.setup(model, optimizer)`)."
            )
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
        try:
            dataloader.state_dict()
            positioned = True
        except (TypeError, ValueError, RuntimeError):
            positioned = False
        sampler = getattr(dataloader, "sampler", None)
        if positioned and not hasattr(sampler, "resume"):
            raise ValueError(
                f"This DataLoader reads its data through a sampler of your own ({type(sampler).__name__}):"
                " a replica group that rejoins mid-epoch could not take the live groups' position in"
                " it (it would raise then), and the data is not split across groups. Let minifabric"
                " split and position it: `acc.setup_dataloaders(loader)` (use_distributed_sampler=True)."
            )
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
        self._join_quorum()
        if self.settings.min_replica_groups > 1:
            self._wait_for_enough_groups()
        self._in_step = self._quorum_made = True

    def _join_quorum(self) -> None:
        manager = self._manager
        manager.start_quorum()
        # The first step heals before the forward (see the module docstring). So does every step
        # that waits for `min_replica_groups`: it waits for the quorum anyway, and asking again
        # would drop a heal that is still pending.
        waits = manager.current_step() == 0 or self.settings.min_replica_groups > 1
        if self.settings.overlap_quorum and waits:
            manager.wait_quorum()
            self._heal_now()

    def _wait_for_enough_groups(self) -> None:
        """Ask for the quorum again until ``min_replica_groups`` groups take part in it.

        torchft itself would run the step with fewer groups and only refuse its commit, so the loop
        would draw, compute and drop batch after batch while a group is missing. It gives up when
        its pauses add up to ``quorum_timeout``: a count, not a clock, so every rank of the group
        asks the same number of times (each quorum waits for all of them) and all raise together.
        """
        needed, timeout = self.settings.min_replica_groups, self.settings.quorum_timeout
        waited, pause = 0.0, 0.05
        while (live := self.num_participants) < needed:
            if waited >= timeout.total_seconds():
                raise RuntimeError(
                    f"Replica group {self.settings.replica_group_id}: only {live} group(s) took part in"
                    f" the quorum for quorum_timeout={timeout}, and min_replica_groups={needed}, so no"
                    " step could commit. Start the missing groups, wait longer:"
                    " `FaultTolerance(..., quorum_timeout=600)`, or commit with fewer:"
                    f" `FaultTolerance(..., min_replica_groups={max(live, 1)})`."
                )
            if pause == 0.05 and self.group_rank == 0:
                log.warning(
                    "Replica group %d: %d group(s) take part and min_replica_groups=%d: waiting (pauses of"
                    " %s in all) for the others before the next batch is drawn",
                    self.settings.replica_group_id,
                    live,
                    needed,
                    timeout,
                )
            time.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, 1.0)
            self._join_quorum()

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
        """FSDP2's all-reduce hook for one unit: ``shard`` is its flat reduce-scattered gradient."""
        if not self._in_step:
            raise RuntimeError(
                "Gradients were reduced outside a step this replica group joined: run the forward"
                " through what `acc.setup` returned."
            )
        from torch.distributed import ReduceOp

        # A failure (a group died mid-step) is recorded by the manager and makes `commit` False.
        work = self._manager.allreduce(shard, reduce_op=ReduceOp.AVG)
        in_backward = at_backward_end(self._finish_all_reduces)  # the first one run waits for all
        if not in_backward or not _gradients_view(shard, params):
            # FSDP reads `shard` right after this hook returns, or (outside an autograd backward
            # pass) nothing would wait for it later
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
        self._heal_now()

    def _heal_now(self) -> None:
        manager = self._manager
        if manager._healing:  # what torchft's synchronous quorum does (else should_commit would)
            manager._apply_pending_state_dict()
            manager._healing = False

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
        return {
            "modules": self._module_views,
            "optimizers": [optimizer_state(o) for o in self._optimizers],
            "objects": {name: obj.state_dict() for name, obj in self._objects.items()},
        }

    def _load(self, state: dict[str, Any]) -> None:
        sent = (len(state["modules"]), len(state["optimizers"]), sorted(state["objects"]))
        here = (len(self._modules), len(self._optimizers), sorted(self._objects))
        if sent != here:
            raise RuntimeError(
                f"A live replica group sent (modules, optimizers, registered objects) = {sent}, but this"
                f" group has {here}. Every replica group must set up the same models and optimizers and"
                " register the same objects."
            )
        for module, received in zip(self._modules, state["modules"], strict=True):
            load_module_state(module, received)
        for optimizer, received in zip(self._optimizers, state["optimizers"], strict=True):
            load_optimizer_state(optimizer, received)
        for name, obj in self._objects.items():
            obj.load_state_dict(state["objects"][name])
        self.healed_at.append(self.step)


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP reduces in ``unit``'s hook: its own, not those of sharding units inside it."""
    from torch.distributed.fsdp import FSDPModule

    inner = {
        id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in inner]


def _gradients_view(shard: torch.Tensor, params: list[nn.Parameter]) -> bool:
    """Whether FSDP makes ``shard`` the gradients as it is (views), so its all-reduce may finish later.

    FSDP2 reads the buffer right after the hook when it casts it to the parameters' dtype, divides
    it after the reduction (reduce dtypes other than float32/bfloat16), or adds it into gradients
    an earlier backward left; only CPU buffers are deferred (no streams to order).
    """
    return (
        shard.device.type == "cpu"
        and shard.dtype in (torch.float32, torch.bfloat16)
        and all(p.dtype == shard.dtype and p.grad is None for p in params)
    )


def _make_manager(group: ReplicaGroup, store_address: tuple[str, int]) -> Any:
    settings = group.settings
    # torchft's Rust servers log at warning level while they start, unless the user set RUST_LOG
    with process.scoped_environment(defaults={_RUST_LOG_VAR: "warn"}):
        torchft = _import_torchft()
        pg = torchft.ProcessGroupGloo(timeout=settings.timeout)
        return torchft.Manager(
            pg=pg,
            load_state_dict=group._load,
            state_dict=group._state,
            min_replica_size=settings.min_replica_groups,
            use_async_quorum=settings.overlap_quorum,
            timeout=settings.timeout,
            quorum_timeout=settings.quorum_timeout,
            connect_timeout=settings.timeout,
            rank=group.group_rank,
            world_size=group.group_size,
            store_addr=store_address[0],
            store_port=store_address[1],
            lighthouse_addr=settings.lighthouse_address(),
            replica_id=f"replica_group_{settings.replica_group_id}",
        )


def _import_torchft() -> Any:
    try:
        import torchft
    except ImportError as err:
        raise ImportError(
            "Per-step fault tolerance (`FaultTolerance`) runs on torchft, which is not installed:"
            " pip install 'minifabric[ft]'"
        ) from err
    return torchft
