"""Per-step fault tolerance settings: replica groups that keep training when one of them dies.

A job runs as several *replica groups*, each an ordinary minifabric run (its own processes, its own
process group, FSDP inside it) started on its own, for example one ``minifabric run`` or ``torchrun``
per group. Across groups the model is replicated: after each backward every group averages its
gradient shards with the other live groups, the way HSDP averages over its replicate dimension. A
torchft lighthouse (one small server for the whole job) decides every step which groups take
part. When a group dies the others finish the step without it and go on; when it comes back it
copies the weights and optimizer state from a live group over the network (not from disk) and
joins the next step.

This module holds only the settings (it imports neither torch's FSDP nor torchft). The machinery is
the rest of :mod:`minifabric.strategies.ft`, which imports torchft when the run starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

#: environment variable torchft reads for the lighthouse address when none is given
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"


@dataclass(frozen=True)
class FaultTolerance:
    """Settings for per-step fault tolerance across replica groups (on torchft).

    Pass it to a strategy: ``FSDPStrategy(fault_tolerance=FaultTolerance(...))`` shards the model
    inside each group and replicates it across groups. Needs ``pip install 'minifabric[ft]'`` and a
    running lighthouse (``torchft_lighthouse --min_replicas 1``). See ``docs/fault-tolerance.md``.

    Args:
        replica_group_id: this group's number, ``0 <= replica_group_id < num_replica_groups``; the
            same in every process of the group, different between groups.
        num_replica_groups: how many groups the job has at most. The data is split into
            ``num_replica_groups * processes_per_group`` parts, so each group reads its own part.
        lighthouse: the lighthouse's address, e.g. ``"http://host:29510"``. Default: the
            ``TORCHFT_LIGHTHOUSE`` environment variable.
        min_replica_groups: a step is committed only when at least this many groups took part
            (default 1: training goes on as long as one group lives). While fewer take part, the
            live groups wait before the next batch is drawn (no forward, no dropped step), asking
            again until their pauses add up to ``quorum_timeout`` (the quorums' own round trips
            come on top), then raise ``RuntimeError``; with
            ``min_replica_groups=num_replica_groups`` they wait until the missing group is back.
        timeout: how long a collective between groups, the copy of the state to a group that
            rejoins, or the agreement to commit may take (``timedelta`` or seconds).
        quorum_timeout: how long a step waits for the lighthouse to decide which groups take part,
            and how long it waits for ``min_replica_groups`` of them.
        overlap_quorum: ask the lighthouse while the forward runs (torchft's asynchronous quorum)
            instead of before it, hiding its round trip. The cost: a group that rejoins copies a
            live group's state at its first step but its gradient of that step is not used (the
            step averages only the live groups); it contributes from its next step on. Without a
            failure the arithmetic is the same.

    Example:
        >>> from minifabric import Accelerator, FaultTolerance, FSDPStrategy
        >>> ft = FaultTolerance(replica_group_id=0, num_replica_groups=2, lighthouse="http://localhost:29510")
        >>> strategy = FSDPStrategy(fault_tolerance=ft)
    """

    replica_group_id: int
    num_replica_groups: int
    lighthouse: str | None = None
    min_replica_groups: int = 1
    timeout: timedelta | float = timedelta(seconds=60)
    quorum_timeout: timedelta | float = timedelta(seconds=60)
    overlap_quorum: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.overlap_quorum, bool):
            raise ValueError(
                f"overlap_quorum={self.overlap_quorum!r} must be True or False, e.g."
                " `FaultTolerance(..., overlap_quorum=True)`."
            )
        _check_int("num_replica_groups", self.num_replica_groups, 1)
        _check_int("replica_group_id", self.replica_group_id, 0)
        if self.replica_group_id >= self.num_replica_groups:
            raise ValueError(
                f"replica_group_id={self.replica_group_id!r} must be below num_replica_groups="
                f"{self.num_replica_groups!r}: groups are numbered 0 to {self.num_replica_groups - 1},"
                f" e.g. `FaultTolerance(replica_group_id=0, num_replica_groups={self.num_replica_groups})`."
            )
        _check_int("min_replica_groups", self.min_replica_groups, 1)
        if self.min_replica_groups > self.num_replica_groups:
            raise ValueError(
                f"min_replica_groups={self.min_replica_groups!r} is more than num_replica_groups="
                f"{self.num_replica_groups!r}: no step could ever commit. Use a number from 1 to"
                f" {self.num_replica_groups}."
            )
        if self.lighthouse is not None and (
            not isinstance(self.lighthouse, str) or "://" not in self.lighthouse
        ):
            raise ValueError(
                f"lighthouse={self.lighthouse!r} is not an address. Give the lighthouse's URL, e.g."
                ' `FaultTolerance(..., lighthouse="http://host:29510")`, or set TORCHFT_LIGHTHOUSE.'
            )
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            seconds = value.total_seconds() if isinstance(value, timedelta) else value
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
                raise ValueError(
                    f"{name}={value!r} must be a positive number of seconds or a timedelta, e.g."
                    f" `FaultTolerance(..., {name}=60)`."
                )
            object.__setattr__(self, name, _as_timedelta(value))

    def lighthouse_address(self) -> str:
        """The lighthouse's address: ``lighthouse``, else ``TORCHFT_LIGHTHOUSE``.

        Raises:
            ValueError: neither is set.
        """
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_VAR)
        if not address:
            raise ValueError(
                "Per-step fault tolerance needs the lighthouse's address and none was given. Start one"
                " (`torchft_lighthouse --min_replicas 1`) and pass it:"
                ' `FaultTolerance(..., lighthouse="http://host:29510")`, or set TORCHFT_LIGHTHOUSE.'
            )
        return address


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{name}={value!r} must be an integer >= {minimum}, e.g."
            " `FaultTolerance(replica_group_id=0, num_replica_groups=2)`."
        )


def _as_timedelta(value: timedelta | float) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)
