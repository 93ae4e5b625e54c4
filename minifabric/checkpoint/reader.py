"""Reading DCP shard files: metadata without arbitrary unpickling, tensor bytes without extra copies.

DCP writes each saved tensor chunk as a small uncompressed ``torch.save`` archive inside a
``.distcp`` file. DCP's own reader loads every chunk with ``torch.load`` into a fresh tensor and
copies it into the target: three copies of every byte, each into freshly faulted memory. This
reader finds each chunk's bytes in its file (``archive.locate``, which builds nothing), then:

* for the keys named in ``views`` (the weights of a module that ``load`` will copy into the live
  model), when the saved chunk is exactly the target's shard, it maps the file and gives the
  planner a view of the chunk's bytes in place of the target: the page cache is read once, by the
  copy into the model. Every mapped byte is paged in here (``MADV_POPULATE_READ``), so a read error
  is raised now, before anything is applied;
* for every other tensor it reads the chunk's bytes from the file straight into the target's memory.

Requests that fit neither (a region that is not contiguous, another dtype, a format it does not
recognise) go through a temporary buffer or ``torch.load``: slower, never wrong.
"""

from __future__ import annotations

import errno
import io
import math
import mmap
import os
import pickle
import sys
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future

from minifabric.checkpoint.archive import NotPlain, Saved, Window, byte_view, locate, read_exactly
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.tensors import shard_like

# What DCP's `.metadata` pickle may name; anything else is refused before it can run.
_METADATA_MODULES = frozenset({"torch.distributed.checkpoint.metadata"})
_METADATA_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _region(saved: Saved, item: ReadItem) -> tuple[int, int]:
    """The storage index of the region's first element, and how many elements it spans up to its last."""
    first = saved.storage_offset + sum(o * s for o, s in zip(item.storage_offsets, saved.stride, strict=True))
    span = sum((n - 1) * s for n, s in zip(item.lengths, saved.stride, strict=True)) + 1
    return first, span


def _run_start(saved: Saved, item: ReadItem) -> int | None:
    """The file offset of the region ``item`` when it is one run of bytes in row-major order, else None."""
    first, span = _region(saved, item)
    if span != math.prod(item.lengths) or saved.stride != _contiguous_strides(saved.size):
        return None
    return saved.data_offset + first * saved.dtype.itemsize


def _read_region(file: io.FileIO, saved: Saved, item: ReadItem, target: torch.Tensor) -> None:
    """Copy the region ``item`` of the saved tensor into ``target`` (its shape): directly when it can."""
    if target.numel() == 0:
        return
    start = _run_start(saved, item)
    if (
        start is not None
        and target.dtype == saved.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
    ):
        read_exactly(file, start, byte_view(target))
        return
    first, span = _region(saved, item)
    buffer = torch.empty(span, dtype=saved.dtype)
    read_exactly(file, saved.data_offset + first * saved.dtype.itemsize, byte_view(buffer))
    target.copy_(buffer.as_strided(tuple(item.lengths), saved.stride))


_MADV_POPULATE_READ = 22  # Linux >= 5.14: page a range in, reporting errors instead of raising SIGBUS later


class _Mapped:
    """One open shard file, mapped once on first use (copy-on-write: writing to a view never reaches the file)."""

    def __init__(self, file: io.FileIO) -> None:
        self._file = file
        self._map: mmap.mmap | None = None
        self._usable = True

    def close(self) -> None:
        """Unmap the file now, unless a view of it is still alive (then it is unmapped with the last one)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass

    def view(self, saved: Saved, item: ReadItem) -> torch.Tensor | None:
        """The region ``item`` of ``saved`` as a tensor over the mapped file, or None where it is not contiguous."""
        start = _run_start(saved, item)
        count = math.prod(item.lengths)
        if not self._usable or count == 0 or start is None:
            return None
        if self._map is None:
            try:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            except OSError:  # a file system that cannot map files: read into the target instead
                self._usable = False
                return None
        mapped = self._map
        nbytes = count * saved.dtype.itemsize
        page = start - start % mmap.PAGESIZE
        if sys.platform.startswith("linux"):
            try:
                mapped.madvise(_MADV_POPULATE_READ, page, start + nbytes - page)
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOSYS):  # an older kernel: paged in on use
                    raise
        return torch.frombuffer(mapped, dtype=saved.dtype, count=count, offset=start).view(
            tuple(item.lengths)
        )


class SafeReader(FileSystemReader):
    """DCP's file reader that runs no code from the files and reads tensor bytes without extra copies.

    ``views`` names the keys whose values may be replaced by a view of the mapped file (the caller
    copies them out and drops them); every other tensor is read into the target it was given.
    """

    def __init__(self, path: str | os.PathLike, views: Collection[str] = ()) -> None:
        super().__init__(path)
        self._views = frozenset(views)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's ``.metadata``, unpickled with only DCP's metadata classes (read once, then kept)."""
        if self._metadata is None:
            self._metadata = self._read_metadata()
        if self._metadata.storage_meta is not None:
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_metadata(self) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{str(path)!r} is not valid checkpoint metadata: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{str(path)!r} is not valid checkpoint metadata: it holds {type(metadata).__name__}."
            )
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``, file by file in file order, into the planner's targets."""
        infos = self.storage_data
        if any(getattr(infos[item.storage_index], "transform_descriptors", None) for item in plan.items):
            return super().read_data(plan, planner)  # stream transforms (compression) we do not parse
        per_file: dict[str, list[ReadItem]] = {}
        items_per_key: dict[str, int] = {}
        for item in plan.items:
            per_file.setdefault(infos[item.storage_index].relative_path, []).append(item)
            items_per_key[item.dest_index.fqn] = items_per_key.get(item.dest_index.fqn, 0) + 1
        replaced: dict[str, Any] = {}  # the targets that views stand in for
        maps: list[_Mapped] = []
        try:
            for relative_path, items in per_file.items():
                self._read_file(
                    Path(self.path) / relative_path, items, items_per_key, planner, replaced, maps
                )
        except BaseException:
            planner.state_dict.update(replaced)  # type: ignore[attr-defined]  # drop every view: no file stays mapped
            replaced.clear()
            for mapped in maps:
                mapped.close()
            raise
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(
        self,
        path: Path,
        items: list[ReadItem],
        items_per_key: dict[str, int],
        planner: LoadPlanner,
        replaced: dict[str, Any],
        maps: list[_Mapped],
    ) -> None:
        """Read ``items`` of one shard file, in file order."""
        infos = self.storage_data
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            mapped = _Mapped(file)
            maps.append(mapped)
            located: dict[int, Saved | None] = {}
            items.sort(key=lambda i: infos[i.storage_index].offset)
            _read_ahead(file, [infos[item.storage_index] for item in items])
            for item in items:
                info = infos[item.storage_index]
                key = item.dest_index.fqn
                may_view = key in self._views and items_per_key[key] == 1
                try:
                    if info.offset + info.length > size:
                        raise EOFError(
                            f"the file ends at byte {size}, the item at {info.offset + info.length}"
                        )
                    tensor = item.type != LoadItemType.BYTE_IO
                    saved = _saved(file, info, located) if tensor else None
                    if saved is not None:
                        _check_region(saved, item)
                    original = _view_into(mapped, saved, item, planner) if may_view else None
                    if original is not None:
                        replaced[key] = original
                    else:
                        _read_item(file, info, saved, item, planner)
                except (zipfile.BadZipFile, EOFError, OSError) as err:
                    raise CheckpointError(
                        f"{str(path)!r} is damaged: {key!r} at byte {info.offset} cannot be read ({err})."
                    ) from err


def _check_region(saved: Saved, item: ReadItem) -> None:
    """Refuse a read request that reaches outside the saved tensor (DCP's metadata names a bigger chunk)."""
    starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if len(starts) != len(saved.size) or any(
        o < 0 or n < 0 or o + n > size for o, n, size in zip(starts, lengths, saved.size, strict=True)
    ):
        raise EOFError(
            f"the region at {list(starts)} of sizes {list(lengths)} lies outside the saved tensor of sizes"
            f" {list(saved.size)}"
        )


def _read_ahead(file: io.FileIO, infos: list[Any]) -> None:
    """Ask the OS to start reading the span of the items now, so the disk works while earlier items are copied."""
    if hasattr(os, "posix_fadvise") and infos:
        start = min(info.offset for info in infos)
        end = max(info.offset + info.length for info in infos)
        os.posix_fadvise(file.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)


def _saved(file: io.FileIO, info: Any, located: dict[int, Saved | None]) -> Saved | None:
    """Where the tensor archive at ``info`` keeps its bytes (None: read it with ``torch.load``); cached per item."""
    if info.offset not in located:
        try:
            located[info.offset] = locate(file, info.offset, info.length)
        except NotPlain:
            located[info.offset] = None
    return located[info.offset]


def _view_into(mapped: _Mapped, saved: Saved | None, item: ReadItem, planner: Any) -> Any:
    """Put a view of the mapped file in place of the target when the item is all of it; return the target it replaced."""
    if saved is None:
        return None
    key = item.dest_index.fqn
    target = planner.state_dict[key]
    local = target.to_local() if isinstance(target, DTensor) else target
    whole = all(o == 0 for o in item.dest_offsets) and tuple(local.shape) == tuple(item.lengths)
    if not (whole and local.device.type == "cpu" and local.dtype == saved.dtype):
        return None
    view = mapped.view(saved, item)
    if view is None:
        return None
    planner.state_dict[key] = shard_like(view, target) if isinstance(target, DTensor) else view
    return target


def _read_item(file: io.FileIO, info: Any, saved: Saved | None, item: ReadItem, planner: LoadPlanner) -> None:
    """Read ``item`` into its target: bytes for the planner, or the tensor region (see ``_read_region``)."""
    if item.type == LoadItemType.BYTE_IO:
        data = bytearray(info.length)
        read_exactly(file, info.offset, memoryview(data))
        planner.load_bytes(item, io.BytesIO(data))
        return
    target = planner.resolve_tensor(item).detach()
    if tuple(target.shape) != tuple(item.lengths):
        raise CheckpointError(
            f"{item.dest_index.fqn!r}: the target region is {tuple(target.shape)}, the saved one {tuple(item.lengths)}."
        )
    if saved is None:  # not a plain tensor archive: torch's own (weights-only) reader
        whole = torch.load(
            cast(IO[bytes], Window(file, info.offset, info.length)), map_location="cpu", weights_only=True
        )
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            whole = whole.narrow(dim, start, length)
        target.copy_(whole)
    else:
        _read_region(file, saved, item, target)
    planner.commit_tensor(item, target)


__all__ = ["SafeReader"]
