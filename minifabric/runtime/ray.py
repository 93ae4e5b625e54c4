"""Ray Train's notice that a node of the run is about to be preempted, for ``should_stop``.

Ray Train (v2) watches the nodes of a run for a drain (a spot instance being reclaimed, a node the
autoscaler takes away) and tells its workers through ``ray.train.get_preemption_info()``: ``None``
until then, a ``PreemptionInfo`` after. That call is a collective of Ray's own: rank 0's answer is
broadcast to every worker through Ray's synchronization actor, so every worker must call it the
same number of times and every worker gets the same answer. Reading ``should_stop`` is already a
collective that every rank reaches at the same point of the loop, so the rank (:mod:`minifabric.runtime.rank`) calls it there,
exactly once per read on every rank, and ORs the answer into the stop agreement.

Detection asks Ray and never guesses from names or environment variables:

- a Ray Train worker has imported ``ray.train`` before the user's function runs; a process that
  has not is not one (this module never imports ray: outside Ray the cost is one dictionary lookup);
- Ray Train v1 (``RAY_TRAIN_V2_ENABLED=0``) and Ray releases before the call do not export
  ``ray.train.get_preemption_info``: nothing more is read there (SIGTERM and SIGUSR1 still count);
- ``ray.train.get_context()`` answers only inside a function started by ``trainer.fit()`` (Ray
  raises ``RuntimeError`` elsewhere, e.g. in the driver; ``DeprecationWarning`` in a Ray Tune
  function trial);
- inside a worker, Ray's world (rank, size) must be the process group's, or the calls could not be
  counted alike on every rank: a mismatch raises instead of risking a hang.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.distributed as dist


def preemption_reader() -> Callable[[], bool] | None:
    """Where this process is a Ray Train (v2) worker, a function that reads Ray's preemption notice.

    Each call of the returned function is one call of ``ray.train.get_preemption_info()`` (a
    collective of all workers) and returns whether Ray reports a preemption.

    Returns:
        The reader, or None outside a Ray Train worker and under Ray Train v1.

    Raises:
        RuntimeError: Ray Train's rank or world size is not the process group's.

    Example:
        >>> preemption_reader() is None  # not a Ray Train worker
        True
    """
    train = sys.modules.get("ray.train")
    if train is None:
        return None  # a Ray Train worker has imported ray.train before the user's code runs
    get_preemption_info = getattr(train, "get_preemption_info", None)
    if get_preemption_info is None:
        return None  # Ray Train v1, or a Ray without preemption notices: nothing to follow
    try:
        context = train.get_context()
    except (RuntimeError, DeprecationWarning):  # Ray's answer outside a function run by trainer.fit()
        return None
    ray_world = (context.get_world_rank(), context.get_world_size())
    group = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if ray_world != group:
        raise RuntimeError(
            f"This Ray Train worker is rank {ray_world[0]} of {ray_world[1]} for Ray but rank"
            f" {group[0]} of {group[1]} in the process group, so should_stop cannot call"
            " ray.train.get_preemption_info() (a collective of Ray's workers) as often on every"
            " worker. Let the Accelerator adopt the process group Ray Train created (do not destroy"
            " it or create another before Accelerator.launch())."
        )

    def preempted() -> bool:
        return get_preemption_info() is not None

    return preempted
