"""The quorum: which replica groups take part in a step, asked of torchft's ``Manager`` each step.

A group joins the step's quorum before its batch is drawn (or before its forward); with
``min_replica_groups`` above 1 it asks again until that many groups take part. A heal that torchft
left pending (a group that was behind copies a live group's state) is applied here too, at the
points :mod:`minifabric.strategies.ft` names. The manager itself is built here, the one place
torchft is imported.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from minifabric import process
from minifabric.strategies.ft.config import FaultTolerance

if TYPE_CHECKING:
    from minifabric.strategies.ft.replica_group import ReplicaGroup

log = logging.getLogger(__name__)

#: torchft's Rust core logs every quorum at INFO (several lines a step) unless RUST_LOG says otherwise
_RUST_LOG_VAR = "RUST_LOG"


def join_quorum(manager: Any, settings: FaultTolerance) -> None:
    """Ask for this step's quorum; where the step must not overlap it, wait for it and heal now."""
    manager.start_quorum()
    # The first step heals before the forward (see minifabric.strategies.ft). So does every step
    # that waits for `min_replica_groups`: it waits for the quorum anyway, and asking again
    # would drop a heal that is still pending.
    waits = manager.current_step() == 0 or settings.min_replica_groups > 1
    if settings.overlap_quorum and waits:
        manager.wait_quorum()
        heal_now(manager)


def wait_for_enough_groups(manager: Any, settings: FaultTolerance, group_rank: int) -> None:
    """Ask for the quorum again until ``min_replica_groups`` groups take part in it.

    torchft itself would run the step with fewer groups and only refuse its commit, so the loop
    would draw, compute and drop batch after batch while a group is missing. It gives up when
    its pauses add up to ``quorum_timeout``: a count, not a clock, so every rank of the group
    asks the same number of times (each quorum waits for all of them) and all raise together.

    Raises:
        RuntimeError: fewer than ``min_replica_groups`` groups took part for ``quorum_timeout``.
    """
    needed, timeout = settings.min_replica_groups, settings.quorum_timeout
    waited, pause = 0.0, 0.05
    while (live := int(manager.num_participants())) < needed:
        if waited >= timeout.total_seconds():
            raise RuntimeError(
                f"Replica group {settings.replica_group_id}: only {live} group(s) took part in"
                f" the quorum for quorum_timeout={timeout}, and min_replica_groups={needed}, so no"
                " step could commit. Start the missing groups, wait longer:"
                " `FaultTolerance(..., quorum_timeout=600)`, or commit with fewer:"
                f" `FaultTolerance(..., min_replica_groups={max(live, 1)})`."
            )
        if pause == 0.05 and group_rank == 0:
            log.warning(
                "Replica group %d: %d group(s) take part and min_replica_groups=%d: waiting (pauses of"
                " %s in all) for the others before the next batch is drawn",
                settings.replica_group_id,
                live,
                needed,
                timeout,
            )
        time.sleep(pause)
        waited, pause = waited + pause, min(2 * pause, 1.0)
        join_quorum(manager, settings)


def heal_now(manager: Any) -> None:
    """Apply a live group's state that torchft holds pending (what its synchronous quorum does).

    Else torchft would apply it in ``should_commit``, after a clip read the gradients.
    """
    if manager._healing:
        manager._apply_pending_state_dict()
        manager._healing = False


def make_manager(group: ReplicaGroup, store_address: tuple[str, int]) -> Any:
    """torchft's ``Manager`` for ``group``: it serves ``group._state`` and heals with ``group._load``."""
    settings = group.settings
    # torchft's Rust servers log at warning level while they start, unless the user set RUST_LOG
    with process.scoped_environment(defaults={_RUST_LOG_VAR: "warn"}):
        torchft = import_torchft()
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


def import_torchft() -> Any:
    """The ``torchft`` module.

    Raises:
        ImportError: torchft is not installed (with the command that installs it).
    """
    try:
        import torchft
    except ImportError as err:
        raise ImportError(
            "Per-step fault tolerance (`FaultTolerance`) runs on torchft, which is not installed:"
            " pip install 'minifabric[ft]'"
        ) from err
    return torchft
