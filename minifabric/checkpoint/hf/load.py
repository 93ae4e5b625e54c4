"""Loading Hugging Face safetensors (a file, or a ``save_pretrained`` folder) into a set-up model.

Every name and shape is checked from the files' headers before any byte of data is read, on every
rank, and the ranks agree on the outcome before the model is touched. Then each rank reads, for
each tensor, only the box its own shard covers (a sharded parameter's local rows) straight into the
parameter: the peak is the model's own shard plus at most one tensor's box for a dtype conversion.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from minifabric._torch import local_box
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.hf.files import Stored, read_box, read_headers
from minifabric.checkpoint.ties import tied_groups

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
_SHOWN = 10


def map_keys(stored: dict[str, Stored], key_map: KeyMap | None) -> dict[str, Stored]:
    """The stored tensors under the model's names: ``key_map`` maps a stored name to a model name (None skips it).

    A mapping renames the names it lists and keeps the others; a callable is asked for every name.
    """
    if key_map is None:
        return stored
    if isinstance(key_map, Mapping):
        unknown = [k for k in key_map if k not in stored]
        if unknown:
            raise ValueError(
                f"key_map names tensors that are not in the file: {unknown[:_SHOWN]}{_hint(unknown[0], stored)}."
                " Its keys are the file's names, its values the model's: `key_map={'file.name': 'model.name'}`."
            )
        rename: Callable[[str], str | None] = lambda name: key_map.get(name, name)  # noqa: E731
    elif callable(key_map):
        rename = key_map
    else:
        raise TypeError(
            f"key_map must be a dict or a function from the file's names to the model's, got {key_map!r}."
            " Example: `key_map=lambda name: name.removeprefix('model.')`."
        )
    out: dict[str, Stored] = {}
    origin: dict[str, str] = {}
    for name, value in stored.items():
        new = rename(name)
        if new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(
                f"key_map({name!r}) returned {new!r}: return the model's name (a str), or None to skip it."
            )
        if new in out:
            raise ValueError(
                f"key_map maps both {origin[new]!r} and {name!r} to {new!r}; each model name takes one tensor."
            )
        out[new], origin[new] = value, name
    return out


def _hint(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _listing(names: list[str], candidates: Any) -> str:
    shown = [f"{n}{_hint(n, candidates)}" for n in names[:_SHOWN]]
    more = f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(shown) + more


def _prefix_fix(missing: list[str], unexpected: list[str]) -> str:
    """A ``key_map`` that fixes a name prefix the file and the model disagree on, when one does."""
    for model_name in missing:
        for file_name in unexpected:
            if file_name.endswith("." + model_name):
                prefix = file_name[: -len(model_name)]
                return f"key_map=lambda name: name.removeprefix({prefix!r})"
            if model_name.endswith("." + file_name):
                prefix = model_name[: -len(file_name)]
                return f"key_map=lambda name: {prefix!r} + name"
    return "key_map={'name.in.file': 'name.in.model'}"


Read = tuple[str, Stored, torch.Tensor]


def plan(
    path: Path, module: nn.Module, stored: dict[str, Stored], strict: bool
) -> tuple[list[Read], list[str]]:
    """What to read into which live tensor (once per tied group); the names ``strict=False`` tolerated.

    Raises:
        CheckpointError: names missing or unexpected (strict), or any shape mismatch; nothing read yet.
    """
    live = module.state_dict()
    meta = [name for name, tensor in live.items() if isinstance(tensor, torch.Tensor) and tensor.is_meta]
    if meta:
        raise RuntimeError(
            f"The model still has meta tensors ({meta[:3]}): set it up before loading weights into it:"
            " `model = acc.setup(model)`, then `acc.load_raw(path, model)`."
        )
    tie_of = {name: group for group in tied_groups(module) for name in group}
    reads: list[Read] = []
    missing: list[str] = []
    shapes: list[str] = []
    done: set[str] = set()
    for name, tensor in live.items():
        if name in done or not isinstance(tensor, torch.Tensor):
            continue
        group = tie_of.get(name, [name])
        done |= set(group)
        for member in group:
            if member in stored and stored[member].shape != tuple(tensor.shape):
                shapes.append(f"{member}: file {stored[member].shape}, model {tuple(tensor.shape)}")
        present = [member for member in group if member in stored]
        if len(present) > 1 and not _same_bytes([stored[member] for member in present]):
            raise CheckpointError(_untied_message(path, module, present))
        source = present[0] if present else None
        if source is None:
            missing.append(name)  # a tied group is one tensor: named once
        else:
            reads.append((name, stored[source], tensor))
    unexpected = [name for name in stored if name not in live]
    problems = []
    if strict and missing:
        problems.append(f"missing from the file: {_listing(missing, stored)}")
    if strict and unexpected:
        problems.append(f"in the file but not in the model: {_listing(unexpected, live)}")
    if shapes:
        problems.append(f"shape mismatch: {'; '.join(shapes[:_SHOWN])}")
    if problems:
        fix = (
            f" If the names differ only by a prefix: `acc.load_raw(path, model, {_prefix_fix(missing, unexpected)})`;"
            " to load the matching tensors only: `strict=False`."
            if (missing or unexpected) and not shapes
            else ""
        )
        raise CheckpointError(
            f"The safetensors weights at {str(path)!r} do not match the model: {' | '.join(problems)}.{fix}"
        )
    return reads, missing + unexpected


def _same_bytes(tensors: list[Stored]) -> bool:
    """Whether the stored tensors hold the same values (compared chunk by chunk, without keeping them)."""
    first = tensors[0]
    if any(t.dtype != first.dtype or t.shape != first.shape for t in tensors[1:]):
        return False
    if all(t.file == first.file and t.start == first.start for t in tensors[1:]):
        return True
    nbytes = math.prod(first.shape) * first.dtype.itemsize
    with ExitStack() as stack:
        files = [stack.enter_context(open(t.file, "rb")) for t in tensors]
        for f, t in zip(files, tensors, strict=True):
            f.seek(t.start)
        done = 0
        while done < nbytes:
            size = min(_CHUNK, nbytes - done)
            chunks = [f.read(size) for f in files]
            if any(chunk != chunks[0] for chunk in chunks[1:]):
                return False
            done += size
    return True


def _untied_message(path: Path, module: nn.Module, names: list[str]) -> str:
    config = getattr(module, "config", None)
    flag = getattr(config, "tie_word_embeddings", None)
    why = f"`config.tie_word_embeddings={flag}`" if flag is not None else "the model's tied parameters"
    fix = (
        " Build the model with `tie_word_embeddings=False` to load both, or load a file saved from a tied model."
        if flag is not None
        else " Untie them in the model to load both, or load a file saved from a tied model."
    )
    listed = " and ".join(repr(n) for n in names)
    return (
        f"The safetensors weights at {str(path)!r} hold different tensors {listed}, but the model ties them"
        f" ({why}): loading would keep one and silently drop the other. Nothing was loaded.{fix}"
    )


_CHUNK = 1 << 24


def _read_all(reads: list[Read]) -> None:
    with ExitStack() as stack, torch.no_grad():
        files = {}
        for _, stored, tensor in reads:
            if stored.file not in files:
                files[stored.file] = stack.enter_context(open(stored.file, "rb", buffering=0))
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                shape, offsets = local_box(tensor.shape, tensor.device_mesh, tensor.placements)
                if tuple(local.shape) != shape:
                    raise RuntimeError(
                        f"Unexpected local shard shape {tuple(local.shape)} (expected {shape})."
                    )
            else:
                local, offsets = tensor, (0,) * tensor.dim()
            direct = local.device.type == "cpu" and local.is_contiguous() and local.dtype == stored.dtype
            box = local if direct else torch.empty(local.shape, dtype=stored.dtype)
            read_box(files[stored.file], stored, offsets, box)
            if not direct:
                local.copy_(box)
            del box


def load_safetensors(
    comm: Any, path: Path, module: nn.Module, *, strict: bool = True, key_map: KeyMap | None = None
) -> None:
    """Load the safetensors file or model folder at ``path`` into ``module`` (every rank calls it).

    ``comm`` (``rank``, ``all_gather``) lets the ranks agree: a check or read that fails on any rank
    raises the same :class:`CheckpointError` on all of them.
    """
    reads: list[Read] = []
    tolerated: list[str] = []
    error = None
    try:
        reads, tolerated = plan(path, module, map_keys(read_headers(path), key_map), strict)
    except (CheckpointError, ValueError, TypeError, RuntimeError) as err:
        error = err
    _agree(comm, error, "nothing was loaded")
    try:
        _read_all(reads)
        error = None
    except (OSError, CheckpointError, RuntimeError) as err:
        error = CheckpointError(
            f"Reading {str(path)!r} failed ({err}); the model is partly loaded: load it again before training."
        )
    _agree(comm, error, "the model is partly loaded: load it again before training")
    if tolerated:
        warnings.warn(
            f"Loaded {str(path)!r} with strict=False; not loaded: {_listing(tolerated, [])}.", stacklevel=4
        )


def _agree(comm: Any, error: BaseException | None, consequence: str) -> None:
    """Raise on every rank if any rank failed: its own error where it failed, the first failure elsewhere."""
    errors = comm.all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"Loading failed on rank {rank} ({consequence}): {message}")
