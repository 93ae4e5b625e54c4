"""The one-file checkpoint format: written by rank 0 to a temporary name, then renamed into place.

The file is a plain dict ``{"__minifabric__": {...}, "state": {...}}`` of tensors and Python
primitives, read back with ``torch.load(weights_only=True)``: loading never runs code from the file.
A crash mid-save leaves the previous file at ``path`` untouched, because ``os.replace`` is atomic.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.state import collect, kinds, restore, validate

if TYPE_CHECKING:
    from minifabric.strategies.strategy import Strategy

FORMAT_KEY = "__minifabric__"
FORMAT_VERSION = 1


class SaveHandle:
    """Returned by ``save(..., asynchronous=True)``; ``wait()`` blocks until the files are written."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the write has finished."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is complete; re-raise a failure of the write."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise CheckpointError(f"The asynchronous save failed: {self.error}") from self.error


def writable_file_error(path: Path) -> str | None:
    """Why a checkpoint file cannot be written at ``path``, or None."""
    if path.is_dir():
        return (
            f"Cannot save a one-file checkpoint to {str(path)!r}: it is a directory. Choose a file path,"
            f" e.g. {str(path / 'checkpoint.pt')!r}, or save a sharded checkpoint."
        )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"Cannot save to {str(path)!r}: {str(parent)!r} is not a writable directory. Pick a writable location."
    return None


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
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)


def _stage(payload: Any) -> Any:
    """A CPU copy of every tensor, so training may change the originals while the file is written."""
    return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t, payload)


def save(strategy: Strategy, path: Path, state: dict[str, Any], *, asynchronous: bool = False) -> SaveHandle | None:
    """Write ``state`` as one file from rank 0 (every rank must call this)."""
    error = writable_file_error(path) if strategy.is_global_zero else None
    error = strategy.broadcast(error)
    if error:
        raise CheckpointError(error)
    payload = {
        FORMAT_KEY: {"version": FORMAT_VERSION, "world_size": strategy.world_size, "kinds": kinds(state)},
        "state": collect(strategy, state),
    }
    if asynchronous:
        handle = SaveHandle()
        if strategy.is_global_zero:
            staged = _stage(payload)

            def write() -> None:
                try:
                    write_atomic(path, staged)
                except BaseException as err:  # reported by wait()
                    handle.error = err

            handle._thread = threading.Thread(target=write, name="minifabric-save", daemon=False)
            handle._thread.start()
        return handle
    if strategy.is_global_zero:
        try:
            write_atomic(path, payload)
        except OSError as err:
            error = f"Writing the checkpoint {str(path)!r} failed ({err}); the previous file at that path is intact."
    error = strategy.broadcast(error)
    if error:
        raise CheckpointError(error)
    return None


def read(path: Path) -> dict[str, Any]:
    """Read a one-file checkpoint (or a plain state-dict file) with ``weights_only=True``."""
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {str(path)!r}: the path does not exist.")
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is a directory, not a one-file checkpoint.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint that can be loaded safely ({type(err).__name__}: {err})."
        ) from err


def load(strategy: Strategy, path: Path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """Restore ``state`` in place from a one-file checkpoint; return the entries it did not ask for."""
    data = read(path)
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        raise CheckpointError(
            f"{str(path)!r} is not a minifabric checkpoint. For a plain `torch.save(model.state_dict())`"
            " file use `acc.load_raw(path, model)`."
        )
    loaded = data["state"]
    modules = {k: v.state_dict() for k, v in state.items() if isinstance(v, nn.Module)}
    validate(state, modules, loaded, strict)
    return restore(strategy, state, loaded, strict)


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


def load_raw(strategy: Strategy, path: Path, obj: nn.Module | Optimizer, strict: bool = True) -> None:
    """Load a plain state-dict file (or a one-file/consolidated checkpoint) into ``obj``."""
    state_dict = raw_state_dict(read(path), obj, path)
    if isinstance(obj, nn.Module):
        validate({"model": obj}, {"model": obj.state_dict()}, {"model": state_dict}, strict)
        strategy.load_module_state_dict(obj, state_dict, strict=strict)
    else:
        strategy.load_optimizer_state_dict(obj, state_dict)
