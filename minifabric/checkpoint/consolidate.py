"""``minifabric consolidate CKPT_DIR OUT_FILE``: merge a sharded checkpoint into one file.

Every tensor the checkpoint holds is read, wherever it sits in the state: module and optimizer
entries, and the DTensors of plain values (``acc.save(path, model.state_dict())`` under FSDP).

The output is a one-file minifabric checkpoint of full CPU tensors: ``torch.load(weights_only=True)``
reads it, ``acc.load`` restores it on any strategy and ``acc.load_raw(path, model)`` loads its model
entry into a plain module. It runs in one process, without a process group.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minifabric.checkpoint import durable
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import FORMAT_KEY
from minifabric.checkpoint.read import has_refs, open_checkpoint, read_entries
from minifabric.checkpoint.save import writable_file_error


def consolidate(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the sharded checkpoint at ``checkpoint`` as one file at ``output``; return ``output``.

    Example:
        >>> from minifabric.checkpoint.consolidate import consolidate
        >>> consolidate("checkpoints/step-1000", "model.pt")  # doctest: +SKIP
        >>> torch.load("model.pt", weights_only=True)["state"]["model"]  # doctest: +SKIP

    Raises:
        CheckpointError: ``checkpoint`` is not a committed sharded checkpoint, or ``output`` cannot be written.
    """
    src, dst = Path(checkpoint), Path(output)
    if not src.is_dir():
        raise CheckpointError(
            f"{str(src)!r} is not a sharded checkpoint folder; only those need consolidating."
        )
    opened = open_checkpoint(src)
    error = writable_file_error(dst)
    if error:
        raise CheckpointError(error)
    no_layout = lambda path: None  # noqa: E731  (plain full tensors, no process group)
    wanted = {k: (tree, no_layout) for k, tree in opened.tree.items() if has_refs(tree)}
    state = {**opened.tree, **read_entries(opened, wanted)}
    if has_refs(state):  # every reference was read above; a leftover is a bug, never written
        raise CheckpointError(
            f"Consolidating {str(src)!r} left tensor references unread; nothing was written."
        )
    meta = {**opened.meta, "format": "full"}
    dst.parent.mkdir(parents=True, exist_ok=True)
    with durable.replacing(dst) as f:
        torch.save({FORMAT_KEY: meta, "state": state}, f)
    return dst
