"""The checkpoint's own process group and the few object collectives a save needs.

Checkpoint traffic runs on a separate gloo group, created once per strategy on the first save, so
an asynchronous save that is still writing in a background thread never interleaves its
collectives with the training loop's collectives on the default group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class Comm:
    """Rank, world size and object collectives over the checkpoint group (identity with one process)."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # new_group is itself a collective: every rank creates it here, in the same save call.
        self.group = dist.new_group(backend="gloo") if self.distributed else None

    @property
    def is_zero(self) -> bool:
        """Whether this is global rank 0 (which decides paths and writes the commit record)."""
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's object, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_zero else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
