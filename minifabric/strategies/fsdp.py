"""Fully sharded data parallel on FSDP2 (placeholder until the FSDP strategy lands)."""

from __future__ import annotations

from typing import Any

from minifabric.strategies.strategy import Strategy


class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2)."""

    def __init__(self, *, cpu_offload: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.cpu_offload = cpu_offload
