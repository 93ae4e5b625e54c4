"""Checking a checkpoint against what ``state`` asks for, before any tensor is read.

:func:`plan` compares the opened checkpoint's tree with the live modules and optimizers (entries,
kinds, keys, full shapes, optimizer groups) and returns a :class:`LoadPlan`: the saved tree of
each entry to read, in the form the live object loads (a module's keys that it has; an optimizer's
state keyed by the live optimizer's indices), and what ``strict=False`` tolerated. The opened
checkpoint is not changed. Every mismatch raises one message (:func:`mismatch`) naming each problem.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint.errors import CheckpointError
from minifabric.checkpoint.format import kinds, shape_of
from minifabric.checkpoint.names import group_problems, is_named, parameter_names, to_indices
from minifabric.checkpoint.read import Opened


@dataclass(frozen=True)
class LoadPlan:
    """What to read: each module and optimizer entry's saved tree as the live object loads it."""

    trees: dict[str, Any]
    tolerated: list[str]  # keys missing or unexpected under strict=False, for the warning


def plan(opened: Opened, state: dict[str, Any], strict: bool) -> LoadPlan:
    """Validate ``state`` against the checkpoint; return what to read.

    The modules' key and shape problems come first in the message: an optimizer mismatch is
    usually their consequence.

    Raises:
        CheckpointError: naming every problem; nothing has been changed.
    """
    saved: dict[str, Any] = {name: opened.tree.get(name) for name in opened.names()}
    problems: list[str] = []
    missing = [f"{k}{_hint(k, list(saved))}" for k in state if k not in saved]
    unexpected: list[str] = []
    shapes: list[str] = []
    trees: dict[str, Any] = {}
    for name, module in state.items():
        if isinstance(module, nn.Module) and name in opened.tree:
            live = module.state_dict()
            m, u = key_problems(name, live, saved[name])
            missing, unexpected = missing + m, unexpected + u
            shapes += shape_problems(name, live, saved[name])
            trees[name] = {k: v for k, v in opened.tree[name].items() if k in live}
    if strict and missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("in the checkpoint but not in the model: " + ", ".join(unexpected))
    if shapes:
        problems.append("shape mismatch: " + "; ".join(shapes))
    saved_kinds = opened.kinds
    problems += [
        f"{key}: checkpoint holds a {saved_kinds[key]}, state has a {kind}"
        for key, kind in kinds(state).items()
        if key in saved_kinds and saved_kinds[key] != kind
    ]
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    for key, optimizer in state.items():
        if isinstance(optimizer, Optimizer) and key in opened.tree:
            tree, found = _optimizer_tree(key, optimizer, opened.tree[key], modules)
            trees[key] = tree
            problems += found
    tolerated = missing + unexpected
    if problems:
        raise mismatch(repr(str(opened.path)), problems, strict and bool(tolerated))
    return LoadPlan(trees, tolerated)


def mismatch(where: str, problems: list[str], keys_only_fix: bool) -> CheckpointError:
    """The one error for a checkpoint that does not match what it is loaded into."""
    keys_only = keys_only_fix and not any(p.startswith("shape") for p in problems)
    fix = " Pass `strict=False` to load the matching keys only." if keys_only else ""
    return CheckpointError(
        f"The checkpoint {where} does not match `state`: " + " | ".join(problems) + "." + fix
    )


def module_problems(
    name: str, live: dict[str, Any], saved: dict[str, Any], strict: bool
) -> tuple[list[str], bool]:
    """The problems of loading ``saved`` into a module whose state dict is ``live``; whether keys alone differ."""
    missing, unexpected = key_problems(name, live, saved)
    problems = []
    if strict and missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("in the checkpoint but not in the model: " + ", ".join(unexpected))
    if shapes := shape_problems(name, live, saved):
        problems.append("shape mismatch: " + "; ".join(shapes))
    return problems, bool(missing or unexpected)


def _optimizer_tree(
    key: str, optimizer: Optimizer, saved: Any, modules: list[nn.Module]
) -> tuple[Any, list[str]]:
    """The saved optimizer state keyed by the live optimizer's indices, and why it does not fit."""
    if is_named(saved):
        names = parameter_names(optimizer, modules)
        found = group_problems(key, saved, optimizer, names)
        return (to_indices(saved, names) if not found and names is not None else saved), found
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return saved, [f"{key}: the checkpoint entry is not an optimizer state dict"]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", [])) for g in groups]
    if mine != theirs:
        return saved, [f"{key}: parameters per group: checkpoint {theirs}, optimizer {mine}"]
    return saved, []


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
