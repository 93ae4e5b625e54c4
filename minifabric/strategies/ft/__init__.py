"""Per-step fault tolerance across replica groups (on torchft), as one component of a strategy.

A job runs as several *replica groups*, each an ordinary minifabric run; the model is replicated
across groups and a torchft lighthouse decides every step which groups take part. The story of a
run, module by module:

1. **Config** (:mod:`~minifabric.strategies.ft.config`): :class:`~minifabric.FaultTolerance`, the
   settings, checked when created (no torch FSDP, no torchft). The strategy hands them to
   :func:`~minifabric.strategies.ft.component.build_fault_tolerance`, which returns the component
   (:mod:`~minifabric.strategies.ft.component`): :class:`NoFaultTolerance` without settings (every
   hook does nothing), else the torchft one. The strategy calls the component's hooks
   unconditionally: at ``acc.launch()`` it builds this process's
   :class:`~minifabric.strategies.ft.replica_group.ReplicaGroup` (torchft's ``Manager``), and the
   set-up models, optimizers, loaders, scheduler and precision are watched
   (:mod:`~minifabric.strategies.ft.watch` refuses what could not be averaged or healed).
2. **Quorum** (:mod:`~minifabric.strategies.ft.quorum`): before a loader set up by the Accelerator
   draws the step's batch (else before the step's first forward through the set-up model),
   ``ReplicaGroup.begin_step`` asks the lighthouse which groups take part; with
   ``min_replica_groups`` it asks again until that many do.
3. **Heal** (:mod:`~minifabric.strategies.ft.heal`): a group that is behind (it was restarted)
   copies a live group's state into its own over the network (rank ``r`` from rank ``r``: the
   local shards, the optimizers' states, the registered objects), after checking that both hold
   the same things, before anything of the step runs.
4. **Gradients**: in backward, each gradient buffer the strategy hands over (FSDP2: each sharding
   unit's flat reduce-scattered shard, :mod:`~minifabric.strategies.ft.fsdp_gradients`) is averaged
   with the same buffer of the other live groups over torchft's reconfigurable gloo group. The
   all-reduce runs while backward goes on and all of them are waited for once, when the backward
   pass ends (before ``backward()`` returns, so clipping and the optimizer read averaged
   gradients); where the strategy reads the buffer right after the hook, it is waited for at once.
5. **Step commit**: ``optimizer.step()`` calls ``ReplicaGroup.commit``: the ranks of this group
   agree whether the step went through everywhere (no collective failed, enough groups took
   part); only then does the optimizer step. A failed step is dropped by every rank of the group
   (the loss scale of ``"16-mixed"`` stays as it was).

By default the quorum is synchronous (torchft's ``use_async_quorum=False``): a group that heals does
so before its forward and then contributes a real gradient to that same step, so training equals a
run without the failure from that step on. With ``FaultTolerance(overlap_quorum=True)`` the quorum
is torchft's asynchronous one: asked for in ``begin_step`` and waited for by the first cross-group
all-reduce in backward, so the lighthouse round trip runs under the forward. A group that is behind
then heals when its backward ends (before a clip or the optimizer reads the gradients) and
contributes a zero gradient to that step (torchft counts only the groups at the latest step). The
first step of a process is the exception: its quorum is waited for and a heal applied before the
forward, as in the synchronous mode, because at step 0 torchft would count the group that copies
the initial weights as taking part and halve the gradients; at a rejoin the group still counts as
not taking part.

Only ``FSDPStrategy`` takes ``fault_tolerance`` today. A DDP integration (torchft supports DDP)
would need no change in ``fsdp.py``: ``DDPStrategy`` would take the same ``fault_tolerance=``
argument, build its component with ``build_fault_tolerance(config, DDPGradients())`` and call the
same hooks at the same points (launch, set-up of models, optimizers, loaders and scheduler, the
forward, the optimizer step, the data split, who writes checkpoints, teardown). Only
``DDPGradients`` would be new: its ``attach`` would register a DDP communication hook that, after a
bucket's all-reduce inside the group, hands the bucket to ``average`` (the cross-group average), and
its ``defers`` would answer False, so that all-reduce is waited for inside the hook (overlapping it
would mean returning torchft's future to DDP instead). The quorum, the heal (plain tensors travel
as they are, DTensors as local shards), the commit and the checks use nothing of FSDP.
"""

from minifabric.strategies.ft.component import (
    GradientHooks,
    NoFaultTolerance,
    ReplicaGroupComponent,
    TorchFTFaultTolerance,
    build_fault_tolerance,
)
from minifabric.strategies.ft.config import FaultTolerance

__all__ = [
    "FaultTolerance",
    "GradientHooks",
    "NoFaultTolerance",
    "ReplicaGroupComponent",
    "TorchFTFaultTolerance",
    "build_fault_tolerance",
]
