"""Checkpoint formats: one file (``full``) and, under FSDP, a sharded folder (``sharded``)."""

from minifabric.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
