"""Where a ``torch.save`` archive of one tensor keeps its bytes, read without building the tensor.

DCP writes every saved tensor chunk as a small uncompressed ``torch.save`` archive (a zip file)
inside a ``.distcp`` file. ``locate`` reads the archive's index and its ``data.pkl`` (a few hundred
bytes) through an unpickler that admits only the tensor-rebuild call and the storage classes, and
returns where the tensor's elements lie in the file and how they are laid out. Anything else (a
tensor subclass, another byte order, a compressed entry) raises ``NotPlain``: the caller reads such
an archive with ``torch.load(weights_only=True)`` instead.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

# The storage classes that ``torch.save`` names for a plain tensor, by dtype.
_STORAGE_DTYPES = MappingProxyType({
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
})


@dataclass(frozen=True)
class Saved:
    """Where a saved tensor's elements lie in its file, and how they are laid out (in elements)."""

    data_offset: int  # file offset of the storage's first byte
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class NotPlain(Exception):
    """The archive holds something other than one plain CPU tensor: read it with ``torch.load``."""


def _rebuild(
    storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None,
    metadata: Any = None, *rest: Any,
) -> tuple:  # fmt: skip
    if metadata or rest:  # e.g. {"conj": True}: the stored values are not the tensor's values
        raise NotPlain(f"tensor metadata {metadata!r}")
    return storage, storage_offset, tuple(size), tuple(stride)


class _TensorUnpickler(pickle.Unpickler):
    """Reads a plain tensor's ``data.pkl`` into ``(storage, offset, size, stride)``; builds nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotPlain(repr(pid))
        _, dtype, key, _location, numel = pid
        return dtype, str(key), int(numel)


class Window(io.RawIOBase):
    """The byte range ``[start, start + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, file: io.FileIO, start: int, length: int) -> None:
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._pos)
        self._file.seek(self._start + self._pos)
        done = self._file.readinto(view[:count]) or 0
        self._pos += done
        return done


def _entry_offset(window: Window, info: zipfile.ZipInfo) -> int:
    """Where the bytes of the stored (uncompressed) archive entry ``info`` begin in ``window``."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise NotPlain(f"{info.filename} is compressed")
    window.seek(info.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header of {info.filename}")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _entry_bytes(window: Window, info: zipfile.ZipInfo) -> bytes:
    """A small entry's bytes. Read without ``zipfile``'s CRC check: checkpoints are saved without CRCs."""
    window.seek(_entry_offset(window, info))
    data = window.read(info.file_size)
    if len(data) != info.file_size:
        raise zipfile.BadZipFile(f"{info.filename} is truncated")
    return data


def locate(file: io.FileIO, start: int, length: int) -> Saved:
    """Parse the ``torch.save`` archive at ``[start, start + length)`` of ``file``: where its tensor's bytes are."""
    window = Window(file, start, length)
    with zipfile.ZipFile(window) as archive:
        entries = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    if "data.pkl" not in entries:
        raise zipfile.BadZipFile("no data.pkl")
    if "byteorder" in entries and _entry_bytes(window, entries["byteorder"]).decode() != sys.byteorder:
        raise NotPlain("another byte order")
    try:
        (dtype, key, numel), storage_offset, size, stride = _TensorUnpickler(
            io.BytesIO(_entry_bytes(window, entries["data.pkl"]))
        ).load()
    except (pickle.UnpicklingError, ValueError, TypeError) as err:
        raise NotPlain(str(err)) from err
    info = entries.get(f"data/{key}")
    nbytes = numel * dtype.itemsize
    if info is None or info.file_size != nbytes:
        raise zipfile.BadZipFile(f"the storage data/{key} of {nbytes} bytes is missing")
    data_offset = _entry_offset(window, info)
    if data_offset + nbytes > length:
        raise zipfile.BadZipFile("the storage runs past the item")
    check_layout(size, stride, storage_offset, numel)
    return Saved(start + data_offset, dtype, size, stride, storage_offset)


def check_layout(size: tuple, stride: tuple, storage_offset: Any, numel: int) -> None:
    """Refuse a layout whose elements do not all lie inside its storage of ``numel`` elements.

    ``torch.load`` refuses such a record too; reading it by offsets would take bytes of the
    neighbouring records (damaged metadata).

    Raises:
        zipfile.BadZipFile: naming the layout and the storage size.
    """
    layout = f"storage_offset {storage_offset}, sizes {list(size)}, strides {list(stride)}"
    ints = all(isinstance(n, int) and not isinstance(n, bool) for n in (storage_offset, *size, *stride))
    if not ints or len(size) != len(stride):
        raise zipfile.BadZipFile(f"the tensor layout is malformed ({layout})")
    if storage_offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise zipfile.BadZipFile(f"the tensor layout has a negative entry ({layout})")
    if 0 in size:
        return
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= numel:
        raise zipfile.BadZipFile(
            f"the tensor ({layout}) reaches element {last} of a storage of {numel} elements"
        )


def read_exactly(file: io.FileIO, offset: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes of ``file`` from ``offset``; ``EOFError`` where the file ends first."""
    file.seek(offset)
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise EOFError(f"the file ends {len(view) - done} bytes early")
        done += count


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as writable bytes (to read a file straight into it)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


__all__ = ["NotPlain", "Saved", "Window", "byte_view", "locate", "read_exactly"]
