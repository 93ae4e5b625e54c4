"""The one-file format: written by rank 0 to a temporary name, then renamed into place.

The file is a plain dict ``{"__minifabric__": meta, "state": {...}}`` of full tensors and Python
primitives, read back with ``torch.load(weights_only=True)``: loading never runs code from the file.
A crash mid-save leaves the previous file at ``path`` untouched, because ``os.replace`` is atomic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint import fabric
from minifabric.checkpoint.commit import fsync_path, unwritable_parent_error
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.state import FORMAT_KEY, load_module, load_optimizer, validate


def writable_file_error(path: Path) -> str | None:
    """Why a checkpoint file cannot be written at ``path``, or None."""
    if path.is_dir():
        return (
            f"Cannot save a one-file checkpoint to {str(path)!r}: it is a directory. Choose a file path,"
            f" e.g. {str(path / 'checkpoint.pt')!r}, or save a sharded checkpoint."
        )
    return unwritable_parent_error(path)


def write_atomic(path: Path, payload: Any) -> None:
    """``torch.save`` to a temporary sibling, fsync, then rename onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path) -> Any:
    """Read a one-file checkpoint (or a plain state-dict file) with ``weights_only=True``."""
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.")
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint folder, not one file. Load it with"
            f" `acc.load(path, {{'model': model}})`, or merge it first: `minifabric consolidate {path} model.pt`."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        unsupported = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
        if unsupported:  # a pickle that names classes: loading it would run their code
            raise CheckpointError(
                f"{str(path)!r} needs unpickling of arbitrary classes ({unsupported[0]}), which loading never"
                " does. If you trust the file, convert those values once: `data = torch.load(path,"
                " weights_only=False)`, replace them by plain values (e.g. `vars(args)`), `torch.save(data, path)`."
            ) from err
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint that can be loaded safely ({type(err).__name__}: {err})."
        ) from err


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(meta, state)`` of a one-file minifabric checkpoint."""
    data = read(path)
    if isinstance(data, dict) and FORMAT_KEY not in data and fabric.is_fabric_file(data):
        return fabric.file_layout(data)
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        raise CheckpointError(
            f"{str(path)!r} is not a minifabric checkpoint. For a plain `torch.save(model.state_dict())`"
            " file use `acc.load_raw(path, model)`."
        )
    return data[FORMAT_KEY], data["state"]


def raw_state_dict(data: Any, obj: nn.Module | Optimizer, path: Path) -> dict[str, Any]:
    """The state dict inside a raw file: the file itself, or the matching entry of a minifabric checkpoint."""
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        return data
    wanted = "module" if isinstance(obj, nn.Module) else "optimizer"
    entries = [k for k, kind in data[FORMAT_KEY]["kinds"].items() if kind == wanted]
    if len(entries) == 1:
        return data["state"][entries[0]]
    if wanted == "module" and "model" in entries:
        return data["state"]["model"]
    raise CheckpointError(
        f"{str(path)!r} holds {len(entries)} {wanted} entries ({entries}); say which one with"
        f" `acc.load(path, {{{entries[0] if entries else 'name'!r}: obj}})`."
    )


def load_raw(path: Path, obj: nn.Module | Optimizer, strict: bool = True) -> None:
    """Load a plain state-dict file (or a one-file/consolidated checkpoint) into ``obj``."""
    state_dict = raw_state_dict(read(path), obj, path)
    if isinstance(obj, nn.Module):
        validate({"model": obj}, {"model": obj.state_dict()}, {"model": state_dict}, strict)
        load_module(obj, state_dict, strict=strict)
    else:
        load_optimizer(obj, state_dict)
