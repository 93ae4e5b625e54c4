"""Strategies: how a model is placed, wrapped and synchronized across processes.

``FSDPStrategy`` and ``ModelParallelStrategy`` are imported on first use: torch's FSDP and DTensor modules take about half a
second to import, which a run that does not shard should not pay.
"""

from typing import TYPE_CHECKING, Any

from minifabric.strategies.ddp import DDPStrategy
from minifabric.strategies.ft.config import FaultTolerance
from minifabric.strategies.init_context import wrap
from minifabric.strategies.single import SingleDeviceStrategy
from minifabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from minifabric.strategies.fsdp import FSDPStrategy
    from minifabric.strategies.model_parallel import ModelParallelStrategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "FaultTolerance",
    "ModelParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "wrap",
]


def __getattr__(name: str) -> Any:
    if name == "FSDPStrategy":
        from minifabric.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if name == "ModelParallelStrategy":
        from minifabric.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
