"""Private parts of ``torch.serialization`` and DCP's file layout."""

from __future__ import annotations

from typing import Any

import torch


def save_without_crc32(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` without the CRC32 of every record, for this call only.

    ``torch.serialization.set_crc32_options`` is process-wide: flipping it from a background save
    would drop the checksums of a user's own ``torch.save`` running meanwhile. This builds the
    archive writer with the option given per call instead (the CRC32 costs about a third of the
    write time of a shard; completeness is checked by the commit record's file sizes).
    """
    import pickle

    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

    writer = torch._C.PyTorchFileWriter(stream, False, _get_storage_alignment())
    try:
        _save(obj, writer, pickle, DEFAULT_PROTOCOL, False)
    finally:
        writer.write_end_of_file()
    stream.flush()


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one saved item lies in a ``.distcp`` file (``_StorageInfo``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
