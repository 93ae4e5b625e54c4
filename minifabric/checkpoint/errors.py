"""The exceptions every checkpoint failure surfaces as."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message says why and what to do."""


class UnsaveableValueError(CheckpointError, TypeError):
    """A value in ``state`` could not be read back by ``load``; refused at ``save``, before anything is written."""
