"""Writing DCP shard files: DCP's file layout, each tensor archived without CRC32 records.

DCP's own writer archives every tensor chunk with ``torch.save``, whose CRC32 is switched by a
process-wide setting; a background save must not flip it while the training loop (or the user's
code) saves files of its own. :class:`ShardWriter` writes the same files DCP writes (one
``__{rank}_0.distcp`` per rank: raw bytes of non-tensor items, then one uncompressed ``torch.save``
archive per tensor chunk, fsynced) with the CRC32 turned off for its own archives only, so
``reader.SafeReader`` and DCP's reader read them alike.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from minifabric._torch import dcp_storage_info, save_without_crc32

SUFFIX = ".distcp"


class ShardWriter(FileSystemWriter):
    """DCP's file writer, one file per rank, tensor archives without CRC32 (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        # The options this writer relies on are given explicitly, so a changed default in a later torch
        # changes nothing here. ``overwrite=False``: ``path`` is a staging folder made new for this
        # save; a ``.metadata`` already in it would mean two saves share it, and is refused.
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan`` into this rank's shard file; return where each one lies."""
        name = f"{plan.storage_data.prefix}0{SUFFIX}"
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            for item in items:
                offset = stream.tell()
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().size() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: archive its own elements, not the whole storage
                    save_without_crc32(tensor, stream)
                length = stream.tell() - offset
                results.append(WriteResult(item.index, length, dcp_storage_info(name, offset, length)))
            stream.flush()
            os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


__all__ = ["ShardWriter"]
