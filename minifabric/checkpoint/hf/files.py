"""The safetensors file format, read and written a region at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. Reading the header alone gives every name and shape
(so a load is validated before any data is touched), and any box of a tensor can be read with a few
``pread``-sized reads: a rank reads only the rows of its own shard. Writing the header first, from
shapes and dtypes alone, lets an export stream one tensor at a time.

A Hugging Face model folder holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {name: file}}``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from minifabric.checkpoint import durable
from minifabric.checkpoint.archive import byte_view, read_exactly
from minifabric.checkpoint.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
})
CODES = MappingProxyType({dtype: code for code, dtype in DTYPES.items()})


@dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file: where its bytes start, its dtype and its shape."""

    file: Path
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` is a ``.safetensors`` file or a folder holding Hugging Face safetensors weights."""
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file())


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a file or model folder (the shards its index names, in order)."""
    if path.is_file():
        return [path]
    if (path / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{str(path / INDEX_NAME)!r} is not a safetensors index: {err!r}.") from err
        return [path / name for name in dict.fromkeys(weight_map.values())]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    raise CheckpointError(
        f"No safetensors weights in {str(path)!r}: expected {WEIGHTS_NAME!r} or {INDEX_NAME!r}"
        " (as written by `model.save_pretrained(folder)`)."
    )


def read_header(file: Path) -> dict[str, Stored]:
    """Every tensor of ``file`` by name, from its header only; checks that the file holds all their bytes."""
    try:
        with open(file, "rb", buffering=0) as f:  # unbuffered: read the header's bytes, no more
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        size = file.stat().st_size
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"{str(file)!r} is not a readable safetensors file ({err}).") from err
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = DTYPES[info["dtype"]], tuple(int(n) for n in info["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{str(file)!r}: unsupported header entry {name!r}: {info!r}.") from err
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
            raise CheckpointError(
                f"{str(file)!r} is truncated or damaged: the bytes of {name!r} are not all in the file."
            )
        out[name] = Stored(file, 8 + length + begin, dtype, shape)
    return out


def read_headers(path: Path) -> dict[str, Stored]:
    """Every tensor of the safetensors file or model folder at ``path``, by name (headers only)."""
    if not path.exists():
        raise CheckpointError(f"No safetensors weights at {str(path)!r}: the path does not exist.")
    out: dict[str, Stored] = {}
    for file in weight_files(path):
        for name, stored in read_header(file).items():
            if name in out:
                raise CheckpointError(f"{name!r} is stored twice, in {out[name].file.name} and {file.name}.")
            out[name] = stored
    return out


def read_box(f: Any, stored: Stored, offsets: tuple[int, ...], out: torch.Tensor) -> None:
    """Read the box of ``stored`` starting at ``offsets`` with ``out``'s shape into ``out`` (contiguous, CPU).

    A box whose rows are contiguous in the file (e.g. a range of dim-0 rows: an FSDP shard) is one
    read; any other box is read one contiguous run at a time.
    """
    shape, lengths = stored.shape, tuple(out.shape)
    if out.numel() == 0:
        return
    partial = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    if not partial or all(lengths[d] == 1 for d in range(partial[-1])):
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        _read_into(f, stored.start + first * stored.dtype.itemsize, out)
        return
    for i in range(lengths[0]):
        row = Stored(stored.file, stored.start + (offsets[0] + i) * math.prod(shape[1:]) * stored.dtype.itemsize,
                     stored.dtype, shape[1:])  # fmt: skip
        read_box(f, row, offsets[1:], out[i])


def _read_into(f: Any, position: int, out: torch.Tensor) -> None:
    try:
        read_exactly(f, position, byte_view(out))
    except EOFError as err:
        raise CheckpointError(f"{f.name!r} ended early: it is truncated.") from err


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ValueError(
            f'max_shard_size={size!r} is not a size. Use bytes or a string, e.g. `max_shard_size="2GB"`.'
        )
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
    value = int(float(match[1]) * units[(match[2] or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive.")
    return value


@dataclass
class Item:
    """A tensor to write: its name, shape and dtype in the file, and how to get its data when it is written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor | None]

    @property
    def nbytes(self) -> int:
        """Its size in the file."""
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(items: list[Item], max_shard_size: int | None) -> list[tuple[str, list[Item]]]:
    """Group ``items`` (in order) into files of at most ``max_shard_size`` bytes, named as Hugging Face does.

    A tensor larger than the cap gets a file of its own. One file is ``model.safetensors``.
    """
    groups: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if max_shard_size is not None and groups[-1] and size + item.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    if len(groups) == 1:
        return [(WEIGHTS_NAME, groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", group) for i, group in enumerate(groups)]


def _header(items: Iterable[Item]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        header[item.name] = {"dtype": CODES[item.dtype], "shape": list(item.shape),
                             "data_offsets": [offset, offset + item.nbytes]}  # fmt: skip
        offset += item.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(file: Path, items: list[Item], write: bool) -> str | None:
    """Fetch every item in order; where ``write``, stream them into ``file`` durably (``durable.replacing``).

    Ranks that do not write still fetch, and a writer whose disk fails keeps fetching too, so
    collective fetches (gathering a sharded tensor) always line up. Returns why writing failed, or None.
    """
    fetched = 0
    try:
        with durable.replacing(file) if write else nullcontext(None) as f:
            if f is not None:
                f.write(_header(items))
            for item in items:
                tensor = item.fetch()
                fetched += 1
                if f is None or tensor is None:
                    continue
                data = tensor.detach().to("cpu", item.dtype).contiguous()
                del tensor
                if tuple(data.shape) != item.shape:
                    raise OSError(
                        f"{item.name!r} has shape {tuple(data.shape)}, the header says {item.shape}"
                    )
                f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    except OSError as err:
        for item in items[fetched:]:  # the other ranks fetch them too
            item.fetch()
        return f"writing {str(file)!r} failed ({err})"
    return None


def write_index(folder: Path, shards: list[tuple[str, list[Item]]]) -> None:
    """Write ``model.safetensors.index.json`` for a sharded export (via a temporary name)."""
    index = {
        "metadata": {"total_size": sum(item.nbytes for _, items in shards for item in items)},
        "weight_map": {item.name: name for name, items in shards for item in items},
    }
    with durable.replacing(folder / INDEX_NAME, "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def remove_stale(folder: Path, keep: set[str]) -> None:
    """Remove weight files of an earlier export in ``folder`` that the new one does not contain."""
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
    for file in folder.iterdir():
        if pattern.fullmatch(file.name) and file.name not in keep:
            file.unlink()
