"""The exception every checkpoint failure surfaces as."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message says why and what to do."""
