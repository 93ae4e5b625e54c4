"""Exporting a model as Hugging Face-ready safetensors, from a live run or from a checkpoint.

The export streams: every file's header is written from shapes and dtypes alone, then each tensor
is fetched (gathered from its shards, or read from the checkpoint), converted and written before the
next one is fetched. Memory stays at about one full tensor beyond what the process already holds.
Tied weights are written once, under the name Hugging Face keeps (see ``ties.py``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import TENSOR_REF, is_ref, ref_dtype
from minifabric.checkpoint.hf.files import (
    INDEX_NAME,
    Item,
    parse_size,
    plan_shards,
    remove_stale,
    write_file,
    write_index,
)
from minifabric.checkpoint.read import Opened, open_checkpoint, read_tensors
from minifabric.checkpoint.ties import tied_groups

_DTYPES = MappingProxyType({
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
})  # fmt: skip


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating dtype to export in (``None`` keeps each tensor's own)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(
        f'dtype={dtype!r} is not a floating dtype. Use e.g. `dtype=torch.bfloat16` or `dtype="bf16"`'
        f" ({', '.join(sorted(_DTYPES))}), or None to keep each tensor's dtype."
    )


def _items(
    entries: list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], Any]]],
    ties: list[list[str]],
    dtype: torch.dtype | None,
    strip_prefix: str | None,
) -> list[Item]:
    """What to write: one item per tensor, tied names dropped but the first, names stripped, dtype chosen."""
    dropped = {name for group in ties for name in group[1:]}
    kept = [entry for entry in entries if entry[0] not in dropped]
    if strip_prefix:
        outside = [name for name, *_ in kept if not name.startswith(strip_prefix)]
        if outside:
            raise ValueError(
                f"strip_prefix={strip_prefix!r}, but {len(outside)} name(s) do not start with it: {outside[:5]}."
                ' Choose the prefix every name shares, e.g. `strip_prefix="model."`, or none.'
            )
    items = []
    for name, shape, own, fetch in kept:
        out = dtype if dtype is not None and own.is_floating_point else own
        items.append(Item(name.removeprefix(strip_prefix or ""), shape, out, fetch))
    return items


def _output(output: str | os.PathLike) -> tuple[Path, bool]:
    """``(folder, single_file)``: a path ending in ``.safetensors`` is one file, anything else a model folder."""
    path = Path(output)
    if path.suffix == ".safetensors":
        if path.is_dir():
            raise CheckpointError(
                f"{str(path)!r} is a folder; name a new file, or export into the folder's parent."
            )
        return path, True
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file. Export into a folder (`{path.with_suffix('')}`) or a `.safetensors` file."
        )
    return path, False


def _write(
    items: list[Item], output: Path, single: bool, max_shard_size: int | None, write: bool
) -> str | None:
    """Write ``items`` as one file or as shards plus an index; returns why writing failed, or None."""
    if single:
        if write:
            output.parent.mkdir(parents=True, exist_ok=True)
        return write_file(output, items, write)
    shards = plan_shards(items, max_shard_size)
    if write:
        output.mkdir(parents=True, exist_ok=True)
    errors = [write_file(output / name, group, write) for name, group in shards]
    error = next((e for e in errors if e), None)
    if write and error is None:
        if len(shards) > 1:
            write_index(output, shards)
        remove_stale(output, {name for name, _ in shards} | ({INDEX_NAME} if len(shards) > 1 else set()))
    return error


def export_module(
    comm: Any,
    module: nn.Module,
    output: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    strip_prefix: str | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``module``'s weights as safetensors; every rank calls, rank 0 writes (see :func:`export_safetensors`).

    A Hugging Face model's ``config`` is written next to the weights (``config.json``).
    """
    chosen, cap = parse_dtype(dtype), None if max_shard_size is None else parse_size(max_shard_size)
    path, single = _output(output)
    if single and cap is not None:
        raise ValueError(
            f"max_shard_size={max_shard_size!r} needs a folder to put the shards in, not {str(path)!r}."
        )

    def fetcher(tensor: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        if isinstance(tensor, DTensor):
            return lambda: tensor.full_tensor().cpu() if comm.is_zero else _discard(tensor.full_tensor())
        return lambda: tensor if comm.is_zero else None

    state = module.state_dict()
    entries = [
        (n, tuple(t.shape), t.dtype, fetcher(t)) for n, t in state.items() if isinstance(t, torch.Tensor)
    ]
    items = _items(entries, tied_groups(module), chosen, strip_prefix)
    error = _write(items, path, single, cap, comm.is_zero)
    if comm.is_zero and error is None and not single:
        error = _write_config(module, path, chosen)
    error = comm.broadcast(error)
    if error:
        raise CheckpointError(f"Exporting to {str(path)!r} failed: {error}")
    return path


def _discard(tensor: torch.Tensor) -> None:
    del tensor


def _write_config(module: nn.Module, folder: Path, dtype: torch.dtype | None) -> str | None:
    config: Any = getattr(module, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return None
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    try:
        config.save_pretrained(folder)
    except OSError as err:
        return f"writing config.json failed ({err})"
    return None


def _module_entry(opened: Opened, entry: str | None) -> str:
    modules = [k for k, kind in opened.meta.get("kinds", {}).items() if kind == "module"]
    if entry is not None:
        if entry not in modules:
            raise ValueError(f"entry={entry!r} is not a model in {str(opened.path)!r}; it holds {modules}.")
        return entry
    if len(modules) == 1:
        return modules[0]
    if "model" in modules:
        return "model"
    raise ValueError(
        f"{str(opened.path)!r} holds {len(modules)} models ({modules}); choose one with `entry={modules[0]!r}`"
        f" (command line: `--entry {modules[0]}`)."
        if modules
        else f"{str(opened.path)!r} holds no model."
    )


def export_safetensors(
    source: str | os.PathLike,
    output: str | os.PathLike,
    *,
    entry: str | None = None,
    dtype: torch.dtype | str | None = None,
    strip_prefix: str | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write the model in a minifabric checkpoint as Hugging Face-ready safetensors; return ``output``.

    Runs in one process, without a process group, reading one tensor at a time from the checkpoint
    (sharded or one file, saved on any number of ranks), so its memory stays near one tensor.

    Args:
        source: a checkpoint written by ``acc.save``.
        output: a folder (``model.safetensors``, or shards plus ``model.safetensors.index.json``
            when ``max_shard_size`` is given and the model is larger), or a path ending in
            ``.safetensors`` for one file.
        entry: which model of the checkpoint (default: the only one, or ``"model"``).
        dtype: the floating dtype to write (e.g. ``"bf16"``); None keeps each tensor's own.
        strip_prefix: removed from the start of every name (e.g. ``"model."`` for a wrapper module);
            every name must start with it.
        max_shard_size: the size cap per file, in bytes or like ``"5GB"``.

    Example:
        >>> from minifabric.checkpoint.hf import export_safetensors
        >>> export_safetensors("checkpoints/step-1000", "my-model", dtype="bf16")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("my-model")  # doctest: +SKIP

    Raises:
        CheckpointError: ``source`` is not a committed checkpoint, or ``output`` cannot be written.
        ValueError: a bad option (nothing is written then).
    """
    chosen, cap = parse_dtype(dtype), None if max_shard_size is None else parse_size(max_shard_size)
    path, single = _output(output)
    if single and cap is not None:
        raise ValueError(
            f"max_shard_size={max_shard_size!r} needs a folder to put the shards in, not {str(path)!r}."
        )
    opened = open_checkpoint(Path(source))
    name = _module_entry(opened, entry)
    tree = opened.tree[name]

    def fetcher(value: Any) -> Callable[[], torch.Tensor]:
        if is_ref(value):
            return lambda: _read_one(opened.path, value)
        return lambda: value

    entries = []
    for key, value in tree.items():
        if is_ref(value):
            entries.append((key, tuple(value["shape"]), ref_dtype(value), fetcher(value)))
        elif isinstance(value, torch.Tensor):
            entries.append((key, tuple(value.shape), value.dtype, fetcher(value)))
    ties = opened.meta.get("tied", {}).get(name, [])
    error = _write(_items(entries, ties, chosen, strip_prefix), path, single, cap, write=True)
    if error:
        raise CheckpointError(f"Exporting to {str(path)!r} failed: {error}")
    return path


def _read_one(path: Path, ref: dict[str, Any]) -> torch.Tensor:
    target = torch.empty(ref["shape"], dtype=ref_dtype(ref))
    read_tensors(path, {ref[TENSOR_REF]: target})
    return target
