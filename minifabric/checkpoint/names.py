"""Optimizer state keyed by parameter name instead of position.

``optimizer.state_dict()`` identifies parameters by their index in ``param_groups``; a model whose
parameters are registered in another order would silently receive another parameter's moments.
Checkpoints therefore store the state and the groups under the parameters' names (the module's
``named_parameters``, the format of torch's ``get_optimizer_state_dict``) and map them back to the
live optimizer's indices on load. torch's own getter is not used: on an optimizer that has not
stepped yet it runs a step to create the state, which would change the run being saved.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from minifabric.parameters import optimizer_parameters

_COMPILED = "_orig_mod."
#: what torch's `checkpoint_wrapper` adds to the names of the parameters it wraps (its state dict drops it)
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def parameter_names(optimizer: Optimizer, modules: list[nn.Module]) -> list[str] | None:
    """The name of every parameter of ``optimizer`` in ``param_groups`` order; None if one belongs to no module."""
    by_id: dict[int, str] = {}
    for module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), name.replace(_COMPILED, "").replace(_CHECKPOINT_WRAPPED, ""))
    names = [by_id.get(id(p)) for p in optimizer_parameters(optimizer)]
    if any(n is None for n in names) or len(set(names)) != len(names):
        return None
    return names  # type: ignore[return-value]


def is_named(state_dict: Any) -> bool:
    """Whether an optimizer state dict (or its tree in a checkpoint) is keyed by parameter name."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    return bool(groups) and any(isinstance(p, str) for g in groups or () for p in g.get("params", []))


def to_names(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``state_dict`` with parameter indices replaced by ``names`` (state keys and groups' ``params``)."""
    if "param_groups" not in state_dict:  # e.g. the empty dict of a ZeRO shard held by another rank
        return state_dict
    state = {names[i] if isinstance(i, int) else i: v for i, v in state_dict.get("state", {}).items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    return {**state_dict, "state": state, "param_groups": groups}


def group_problems(
    entry: str, saved: dict[str, Any], optimizer: Optimizer, names: list[str] | None
) -> list[str]:
    """Why the named optimizer state ``saved`` cannot go into ``optimizer`` (its groups differ), or []."""
    if names is None:
        return [
            f"{entry}: the checkpoint matches optimizer state to parameters by name, and the module this"
            " optimizer updates is not in `state`. Load them together, e.g."
            f" `acc.load(path, {{'model': model, {entry!r}: optimizer}})`"
        ]
    saved_groups = [list(g.get("params", [])) for g in saved["param_groups"]]
    live_groups, start = [], 0
    for group in optimizer.param_groups:
        live_groups.append(names[start : start + len(group["params"])])
        start += len(group["params"])
    if len(saved_groups) != len(live_groups):
        return [
            f"{entry}: the checkpoint has {len(saved_groups)} parameter group(s), the optimizer"
            f" {len(live_groups)}; build the optimizer with the same groups as the saved run"
        ]
    problems = []
    for i, (theirs, mine) in enumerate(zip(saved_groups, live_groups, strict=True)):
        missing = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        if missing or extra:
            problems.append(
                f"{entry}: parameter group {i} differs: not in the checkpoint: {missing or 'none'};"
                f" only in the checkpoint: {extra or 'none'}"
            )
    return problems


def to_indices(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The named ``saved`` state keyed by the live optimizer's indices (after :func:`group_problems` passed)."""
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: v for name, v in saved.get("state", {}).items() if name in index}
    # sorted: the live optimizer's own order, which load_state_dict pairs with its parameters
    groups = [{**g, "params": sorted(index[n] for n in g["params"])} for g in saved["param_groups"]]
    return {**saved, "state": state, "param_groups": groups}
