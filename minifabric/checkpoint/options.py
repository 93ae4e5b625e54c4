"""What a strategy tells the checkpoint service: configuration data, no behaviour.

The facade passes a strategy's :class:`CheckpointOptions` to the service on every save; the service
never sees the strategy itself, and strategies import nothing else from ``checkpoint/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StateDictType = Literal["full", "sharded"]


@dataclass(frozen=True)
class CheckpointOptions:
    """How checkpoints are written.

    Args:
        state_dict_type: ``"full"``: one file written by rank 0 (sharded tensors gathered to it);
            ``"sharded"``: a folder in which every rank writes its own shard. ``load`` reads both.
    """

    state_dict_type: StateDictType = "full"
