"""One process, one device."""

from __future__ import annotations

from minifabric.strategies.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    """Train on one device in one process (``strategy="single"``).

    Example:
        >>> from minifabric import Accelerator
        >>> acc = Accelerator(strategy="single", accelerator="cpu")
    """
