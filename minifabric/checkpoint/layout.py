"""Full (unsharded) state into the live layout of a sharded module or optimizer.

A state dict of full tensors (``torch.load`` of a one-process ``state_dict()``, litgpt's
``lazy_load``, torch's ``get_optimizer_state_dict(..., full_state_dict=True)``) does not go into
a model whose parameters are DTensors: ``nn.Module.load_state_dict`` fails on the mixed types, and
``Optimizer.load_state_dict`` keeps the plain tensors, so the first ``step()`` fails. Every rank
holds the same full tensors, so each keeps its own slice of every tensor laid out like the live
one (no communication), as ``load`` of a consolidated checkpoint does. What cannot be laid out
like its parameter (another shape) is refused before anything is loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from minifabric._torch import laid_out_like, load_post_hooks_are_fsdps, load_pre_hooks_keep_nothing
from minifabric.checkpoint.names import is_named


def module_state(module: nn.Module, state_dict: Any, *, assign: bool = False, strict: bool = False) -> Any:
    """``state_dict`` with every full tensor for a sharded tensor of ``module`` cut to this rank's shard.

    A tensor-like value (one that defines ``__torch_function__``, such as the not-yet-loaded tensors
    of Lightning's ``lazy_load``) is read first. Returns ``state_dict`` itself where ``module`` holds
    no DTensor. Keeps the dict's ``_metadata`` (the modules' state-dict versions).

    With ``strict``, missing and unexpected keys raise before anything is loaded too (torch's own
    ``load_state_dict`` copies every matching tensor first), where every module of ``module`` loads
    with ``nn.Module``'s own code (no load pre-hook but FSDP2's, which may rename keys, and no
    load post-hook, which may forgive them).

    Raises:
        ValueError: a full tensor whose shape differs from the sharded tensor's full shape, a value
            that is no tensor for a sharded tensor, or ``assign=True`` with full tensors (it would
            replace the sharded parameters); nothing is loaded.
        RuntimeError: with ``strict``, keys missing from ``state_dict`` or not in the model; nothing is loaded.
    """
    live = module.state_dict()
    sharded = {k: v for k, v in live.items() if isinstance(v, DTensor)}
    if not sharded or not isinstance(state_dict, dict):
        return state_dict
    if strict and _loads_plainly(module):
        missing = [k for k in live if k not in state_dict]
        unexpected = [k for k in state_dict if k not in live]
        if missing or unexpected:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(module).__name__}: missing key(s): {missing},"
                f" unexpected key(s): {unexpected}. Nothing was loaded. Fix: pass the model's keys, or"
                " `model.load_state_dict(state_dict, strict=False)` to load the matching ones."
            )
    out: dict[str, Any] = OrderedDict()
    wrong: list[str] = []
    for key, value in state_dict.items():
        like = sharded.get(key)
        if like is not None and not isinstance(value, DTensor):
            value = _read(value)
            if not isinstance(value, torch.Tensor):
                wrong.append(f"{key}: state dict a {type(value).__name__}, model a tensor of {tuple(like.shape)}")
            elif tuple(value.shape) != tuple(like.shape):
                wrong.append(f"shape mismatch: {key}: state dict {tuple(value.shape)}, model {tuple(like.shape)}")
            else:
                if assign:
                    raise ValueError(
                        f"load_state_dict(..., assign=True) with the full tensor {key!r} would replace a"
                        " sharded parameter with a plain tensor. Nothing was loaded. Fix:"
                        " `model.load_state_dict(state_dict)` (assign=False) copies each rank's shard in."
                    )
                value = laid_out_like(value, like)
        elif _other_shape(value, live.get(key)):  # an unsharded buffer: torch would load the rest first
            wrong.append(f"shape mismatch: {key}: state dict {tuple(value.shape)}, model {tuple(live[key].shape)}")
        out[key] = value
    if wrong:
        raise ValueError(
            "The state dict does not match the model: "
            + "; ".join(wrong)
            + ". Nothing was loaded."
        )
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _other_shape(value: Any, live: Any) -> bool:
    """Whether plain tensor ``value`` cannot go into ``live`` for its shape (torch takes one element for a scalar)."""
    if not isinstance(value, torch.Tensor) or not isinstance(live, torch.Tensor) or isinstance(live, DTensor):
        return False
    return tuple(value.shape) != tuple(live.shape) and not (live.dim() == 0 and value.shape == (1,))


def _loads_plainly(module: nn.Module) -> bool:
    """Whether ``module`` loads with ``nn.Module``'s own code: the keys it takes are its state dict's."""
    loads, copies = nn.Module.load_state_dict.__code__, nn.Module._load_from_state_dict.__code__
    return getattr(type(module).load_state_dict, "__code__", None) is loads and all(
        load_pre_hooks_keep_nothing(sub)
        and load_post_hooks_are_fsdps(sub)  # another may forgive missing or unexpected keys
        and "_load_from_state_dict" not in vars(sub)
        and getattr(type(sub)._load_from_state_dict, "__code__", None) is copies
        for sub in module.modules()
    )


def _read(value: Any) -> Any:
    """A tensor-like object that is no tensor (it defines ``__torch_function__``) as a tensor."""
    if isinstance(value, torch.Tensor) or not hasattr(type(value), "__torch_function__"):
        return value
    return torch.detach(value)  # dispatched to its `__torch_function__`, which reads it


def refuse_named(state_dict: Any) -> None:
    """Refuse optimizer state keyed by parameter name where it would be paired by position.

    ``Optimizer.load_state_dict`` pairs the saved parameters with the live ones by position and
    ignores their names: state saved for another order of parameters would land on the wrong ones.

    Raises:
        ValueError: ``state_dict``'s groups name their parameters; nothing is loaded.
    """
    if is_named(state_dict):
        raise ValueError(
            "This optimizer state is keyed by parameter name (torch's `get_optimizer_state_dict`), and"
            " `optimizer.load_state_dict` pairs parameters by position, ignoring the names. Nothing was"
            " loaded. Fix: `torch.save(state_dict, path)` and `acc.load_raw(path, optimizer)`, which"
            " matches the names to the set-up model's parameters."
        )


def optimizer_state(optimizer: Optimizer, state_dict: Any, where: str = "optimizer") -> Any:
    """``state_dict`` with every full state tensor of a sharded parameter cut to this rank's shard.

    The saved parameters (indices, or names as torch's ``get_optimizer_state_dict`` writes them) are
    paired with the live ones group by group and by position, as ``Optimizer.load_state_dict``
    pairs them. Returns ``state_dict`` itself where no parameter is a DTensor, or where the groups
    differ in size (``load_state_dict`` then raises its own error).

    Raises:
        ValueError: a state tensor of a sharded parameter that is neither a scalar nor of the
            parameter's full shape (it cannot be sharded like it); nothing is loaded.
    """
    groups = optimizer.param_groups
    if not any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        return state_dict
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or [len(g.get("params", ())) for g in saved] != [
        len(g["params"]) for g in groups
    ]:
        return state_dict
    saved_params = chain.from_iterable(g["params"] for g in saved)
    pairs = dict(zip(saved_params, chain.from_iterable(g["params"] for g in groups), strict=True))
    state: dict[Any, Any] = {}
    for key, values in state_dict.get("state", {}).items():
        param = pairs.get(key)
        if not isinstance(param, DTensor) or not isinstance(values, dict):
            state[key] = values
            continue
        state[key] = {
            name: _state_like(value, param, f"{where}.state[{key!r}][{name!r}]")
            for name, value in values.items()
        }
    return {**state_dict, "state": state}


def _state_like(value: Any, param: DTensor, where: str) -> Any:
    """One state value of sharded ``param``: a full tensor of its shape laid out like it; scalars as they are."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0:
        return value
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{where} has the shape {tuple(value.shape)}, and its parameter is sharded with the full shape"
            f" {tuple(param.shape)}: it cannot be sharded like its parameter. Nothing was loaded. Load the"
            " state of an optimizer of the same parameters (its `state_dict()` on one process, or"
            " `get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))`)."
        )
    return laid_out_like(value, param)
