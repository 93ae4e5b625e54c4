"""``load_raw`` of one file: a plain ``torch.save(model.state_dict())``, or a one-file/consolidated checkpoint.

The file is read with ``torch.load(weights_only=True)`` (mapped); its state dict is checked against
the module (keys, shapes) before anything is loaded into it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import FORMAT_KEY
from minifabric.checkpoint.load import load_module, load_optimizer
from minifabric.checkpoint.read import read_file
from minifabric.checkpoint.validate import mismatch, module_problems


def load_raw(
    path: Path, obj: nn.Module | Optimizer, strict: bool = True, *, weights_only: bool = True
) -> None:
    """Load a plain state-dict file (or a one-file/consolidated checkpoint) into ``obj``.

    Raises:
        CheckpointError: the file cannot be read safely, or does not match ``obj`` (nothing loaded).
    """
    state_dict = raw_state_dict(read_file(path, weights_only=weights_only), obj, path)
    if isinstance(obj, nn.Module):
        problems, keys_differ = module_problems("model", obj.state_dict(), state_dict, strict)
        if problems:
            raise mismatch(repr(str(path)), problems, keys_differ)
        load_module(obj, state_dict, strict=strict)
    else:
        load_optimizer(obj, state_dict)


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
