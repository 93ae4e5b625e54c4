"""Turning a user's ``state`` dict into something to save, and restoring it in place.

``state`` maps names to modules, optimizers, objects with ``state_dict()/load_state_dict()``,
tensors and plain values. These helpers are shared by every checkpoint format.
"""

from __future__ import annotations

import difflib
import io
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint.errors import CheckpointError, UnsaveableValueError
from minifabric.checkpoint.names import parameter_names, to_names
from minifabric.checkpoint.tensors import gather_full, place, shape_of

# Both formats store ``{FORMAT_KEY: meta, "state": {...}}``; meta holds ``version``, ``format``,
# ``world_size``, ``kinds`` (what each entry is) and ``ranks`` (each rank's RNG and stateful states).
FORMAT_KEY = "__minifabric__"
FORMAT_VERSION = 2


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def collect(
    state: dict[str, Any], stateful: dict[str, Any], full: bool, rank: int, world_size: int
) -> dict[str, Any]:
    """The saveable form of ``state`` (collective): module and optimizer state dicts, values as they are.

    For a ``full`` checkpoint every DTensor is gathered, one at a time, into a full CPU tensor kept
    on rank 0 only; otherwise DTensors stay as they are (each rank writes its shard). Optimizer
    state is keyed by parameter name where the module it updates is in ``state``. ``stateful``
    holds the state dicts of the other stateful objects, already taken.
    """
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            tree = value.state_dict()
        elif isinstance(value, Optimizer):
            names = parameter_names(value, modules)
            state_dict = _optimizer_state_dict(value, rank, world_size)
            tree = to_names(state_dict, names) if names is not None else state_dict
        elif key in stateful:
            tree = stateful[key]
        else:
            tree = value
        out[key] = gather_full(tree, keep=rank == 0) if full and key not in stateful else tree
    return out


def _optimizer_state_dict(optimizer: Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    """``optimizer.state_dict()``; torch's ``ZeroRedundancyOptimizer`` gathers its shards to rank 0 first."""
    if world_size > 1 and callable(getattr(optimizer, "consolidate_state_dict", None)):
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # collective: every rank sends its shard
        return optimizer.state_dict() if rank == 0 else {}
    return optimizer.state_dict()


def load_module(module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load a state dict into ``module``; full tensors are cut to this rank's shard where it is sharded."""
    live = module.state_dict()
    module.load_state_dict({k: place(v, live.get(k)) for k, v in state_dict.items()}, strict=strict)


def load_optimizer(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Load an index-keyed optimizer state dict; full state tensors are cut to the shard of their parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        index: {
            name: place(value, params[index]) if isinstance(index, int) and index < len(params) else value
            for name, value in values.items()
        }
        for index, values in state_dict.get("state", {}).items()
    }
    optimizer.load_state_dict({**state_dict, "state": state})


_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Tensor,
)
_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)


def _reads_back(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back (tried in memory)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _fix(value: Any) -> str:
    name = type(value).__name__
    if name == "Namespace":
        return "`vars(args)` turns an argparse.Namespace into a dict"
    if callable(value):
        return "store its name or settings instead of the function or object itself"
    return (
        "convert it to plain values (a dict of numbers, strings, lists and tensors, e.g."
        " `dataclasses.asdict(x)`), or give its class `state_dict()` and `load_state_dict()`"
    )


def refuse_unloadable(values: dict[str, Any]) -> None:
    """Refuse a value that ``load`` could not read back, before anything is written.

    ``values`` maps how to name each value in a message (``"state['args']"``) to the value.

    Checkpoints are read with ``torch.load(weights_only=True)``, which admits tensors, Python
    primitives and containers of them, and no other class.

    Raises:
        UnsaveableValueError: naming the first such value (``state['args']``) and the fix.
    """

    def walk(where: str, value: Any) -> None:
        if type(value) in _CONTAINERS:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{where}[{k!r}]", k)
                    walk(f"{where}[{k!r}]", v)
            else:
                for i, v in enumerate(value):
                    walk(f"{where}[{i}]", v)
        elif not isinstance(value, _PLAIN) and not _reads_back(value):
            raise UnsaveableValueError(
                f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which `load` could not"
                " read back (checkpoints are read with `torch.load(weights_only=True)`, which admits"
                f" tensors and plain Python values only). Nothing was written. Fix: {_fix(value)},"
                " e.g. `state['args'] = vars(args)`."
            )

    for where, value in values.items():
        walk(where, value)


def _hint(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def key_problems(name: str, expected: dict[str, Any], found: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Missing and unexpected keys of module ``name``'s state dict, with close-match hints."""
    missing = [f"{name}.{k}{_hint(k, list(found))}" for k in expected if k not in found]
    unexpected = [f"{name}.{k}{_hint(k, list(expected))}" for k in found if k not in expected]
    return missing, unexpected


def shape_problems(name: str, expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """Tensors of module ``name`` whose shapes differ between the model and the checkpoint."""
    problems = []
    for key, value in expected.items():
        mine, theirs = shape_of(value), shape_of(found.get(key))
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{name}.{key}: checkpoint {theirs}, model {mine}")
    return problems


def validate(
    state: dict[str, Any],
    expected_modules: dict[str, dict[str, Any]],
    loaded: dict[str, Any],
    strict: bool,
    raise_: bool = True,
) -> Any:
    """Check the checkpoint against what ``state`` asks for before anything is changed.

    ``expected_modules`` maps each module entry of ``state`` to its current state dict (shapes are
    the full, unsharded ones). Returns the keys tolerated under ``strict=False`` (with
    ``raise_=False``: the list of problems and those keys).

    Raises:
        CheckpointError: missing entries or keys (strict), or any shape mismatch.
    """
    missing = [f"{k}{_hint(k, list(loaded))}" for k in state if k not in loaded]
    unexpected_keys: list[str] = []
    shapes: list[str] = []
    for name, expected in expected_modules.items():
        if name not in loaded:
            continue
        m, u = key_problems(name, expected, loaded[name])
        missing += m
        unexpected_keys += u
        shapes += shape_problems(name, expected, loaded[name])
    problems = []
    if strict and missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected_keys:
        problems.append("in the checkpoint but not in the model: " + ", ".join(unexpected_keys))
    if shapes:
        problems.append("shape mismatch: " + "; ".join(shapes))
    if not raise_:
        return problems, missing + unexpected_keys
    if problems:
        fix = " Pass `strict=False` to load the matching keys only." if not shapes else ""
        raise CheckpointError("The checkpoint does not match `state`: " + " | ".join(problems) + "." + fix)
    return missing + unexpected_keys


def kinds(state: dict[str, Any]) -> dict[str, str]:
    """What each entry is: ``"module"``, ``"optimizer"``, ``"stateful"`` or ``"value"``."""
    out = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = "module"
        elif isinstance(value, Optimizer):
            out[key] = "optimizer"
        else:
            out[key] = "stateful" if is_stateful(value) else "value"
    return out


def optimizer_problems(name: str, optimizer: Optimizer, saved: Any) -> list[str]:
    """Why the saved state of optimizer ``name`` cannot go into ``optimizer`` (group and parameter counts)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return [f"{name}: the checkpoint entry is not an optimizer state dict"]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", [])) for g in groups]
    if mine != theirs:
        return [f"{name}: parameters per group: checkpoint {theirs}, optimizer {mine}"]
    return []


def kind_problems(state: dict[str, Any], saved_kinds: dict[str, str]) -> list[str]:
    """Entries whose kind (module, optimizer, ...) differs between ``state`` and the checkpoint."""
    mine = kinds(state)
    return [
        f"{key}: checkpoint holds a {saved_kinds[key]}, state has a {kind}"
        for key, kind in mine.items()
        if key in saved_kinds and saved_kinds[key] != kind
    ]
