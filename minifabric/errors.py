"""Exceptions that any layer may raise. The bottom layer: this module imports nothing from minifabric."""

from __future__ import annotations


class PeerFailed(RuntimeError):
    """Raised on the ranks that learn that another rank failed; reported in one line, no traceback."""
