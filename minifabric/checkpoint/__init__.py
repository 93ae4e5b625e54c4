"""Checkpoints: one module per stage of the pipeline, the storage layer below them.

- ``service.py``: the :class:`~minifabric.checkpoint.service.Checkpointer` the facade calls: two
  short drivers (save, load) and the background thread of an asynchronous save.
- ``format.py``: the on-disk schema (format key and version, kinds, tensor references, side record,
  the one safe loader).
- ``save.py``: prepare -> collect -> write -> commit; ``commit.py``: the crash-safe commit protocol.
- ``load.py``: open -> validate -> read -> apply; ``validate.py`` returns the load plan;
  ``read.py`` opens a checkpoint and reads its tensors.
- storage: ``writer.py`` / ``reader.py`` / ``archive.py`` (DCP shard files), ``durable.py`` (fsynced
  replace), ``comm.py`` (the checkpoint group and the agreement that ends every stage).
- ``raw.py`` (``load_raw`` of one file), ``consolidate.py``, ``fabric.py`` (Lightning Fabric's
  checkpoints), ``periodic.py`` (``keep_last``, ``latest_checkpoint``), ``hf/`` (safetensors).
"""

from minifabric.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
