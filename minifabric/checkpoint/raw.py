"""``load_raw`` of one file: a plain ``torch.save(model.state_dict())``, or a one-file/consolidated checkpoint.

The file is read with ``torch.load(weights_only=True)`` (mapped); its state dict is checked against
the module (keys, shapes) before anything is loaded into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint.commit import POINTER, RECORD
from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import FORMAT_KEY
from minifabric.checkpoint.load import load_module, load_optimizer
from minifabric.checkpoint.names import group_problems, is_named, parameter_names, to_indices
from minifabric.checkpoint.read import read_file
from minifabric.checkpoint.tensors import map_tree
from minifabric.checkpoint.validate import mismatch, module_problems


def load_raw(
    path: Path,
    obj: nn.Module | Optimizer,
    strict: bool = True,
    *,
    weights_only: bool = True,
    modules: Sequence[nn.Module] = (),
) -> None:
    """Load a plain state-dict file (or a one-file/consolidated checkpoint) into ``obj``.

    Full tensors go into a sharded module or optimizer as this rank's shard. Optimizer state keyed
    by parameter name (torch's ``get_optimizer_state_dict``, a consolidated checkpoint) is matched
    to the parameters by their names in ``modules`` (the set-up models).

    Raises:
        CheckpointError: the file cannot be read safely, or does not match ``obj`` (nothing loaded).
    """
    if path.is_dir() and not (path / POINTER).is_file() and not (path / RECORD).is_file():
        raise CheckpointError(_not_loadable_folder(path))
    state_dict = raw_state_dict(read_file(path, weights_only=weights_only), obj, path)
    if isinstance(obj, nn.Module):
        problems, keys_differ = module_problems("model", obj.state_dict(), state_dict, strict)
        if problems:
            raise mismatch(repr(str(path)), problems, keys_differ)
        load_module(obj, state_dict, strict=strict)
    else:
        # The file is mapped: a state tensor that no live one receives (a fresh optimizer's, every
        # `step`) would stay a view of it, the file mapped for as long as the optimizer lives.
        state_dict = map_tree(state_dict, lambda _, v: v.clone() if isinstance(v, torch.Tensor) else v)
        try:
            load_optimizer(obj, _by_index(state_dict, obj, list(modules), path))
        except ValueError as err:  # state that cannot be laid out like its parameter: nothing loaded
            raise CheckpointError(f"Loading {str(path)!r} failed: {err}") from None


def _by_index(state_dict: Any, optimizer: Optimizer, modules: list[nn.Module], path: Path) -> Any:
    """An optimizer state dict keyed by parameter name, keyed by the live optimizer's indices instead."""
    if not is_named(state_dict):
        return state_dict
    names = parameter_names(optimizer, modules)
    if names is None:
        raise CheckpointError(
            f"{str(path)!r} matches optimizer state to parameters by name, and no set-up model holds every"
            f" parameter of this {type(optimizer).__name__}. Set the model up first, e.g."
            " `model, optimizer = acc.setup(model, optimizer)`, then `acc.load_raw(path, optimizer)`."
        )
    if problems := group_problems("optimizer", state_dict, optimizer, names):
        raise mismatch(repr(str(path)), problems, False)
    return to_indices(state_dict, names)


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


def _not_loadable_folder(path: Path) -> str:
    """What a folder that is neither a checkpoint nor safetensors weights holds, and what was expected."""
    entries = sorted(path.iterdir())
    shown = [p.name + ("/" if p.is_dir() else "") for p in entries[:8]] + (
        ["..."] if len(entries) > 8 else []
    )
    nested = [p.name for p in entries if p.is_dir() and any(p.glob("*.safetensors*"))]
    hint = ""
    if nested:
        hint = f" Safetensors weights are in its subfolder(s) {nested}: pass one, e.g. {str(path / nested[0])!r}."
    return (
        f"{str(path)!r} is a folder holding {shown or 'nothing'}, with no safetensors weights in it. `load_raw`"
        " expects a `*.safetensors` file, a folder with `model.safetensors` or `model.safetensors.index.json`"
        f" (as written by `save_pretrained`), or one `torch.save` file.{hint}"
    )
