"""Strategies: how a model is placed, wrapped and synchronized across processes."""

from minifabric.strategies.ddp import DDPStrategy
from minifabric.strategies.fsdp import FSDPStrategy
from minifabric.strategies.single import SingleDeviceStrategy
from minifabric.strategies.strategy import Strategy, wrap

__all__ = ["DDPStrategy", "FSDPStrategy", "SingleDeviceStrategy", "Strategy", "wrap"]
