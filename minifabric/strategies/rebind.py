"""Rebinding an optimizer built before ``setup`` to the parameters ``setup`` produced.

Materializing meta parameters or sharding replaces parameter objects; an optimizer created earlier
would keep stepping the old ones and train nothing. Parameters are matched by their qualified name,
which ``to_empty`` and ``fully_shard`` both preserve.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer


def optimizer_parameters(optimizer: Optimizer) -> list:
    """Every parameter of ``optimizer``, group by group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to its first qualified name in ``module``."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def rebind_optimizer(optimizer: Optimizer, names_before: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s parameter groups at ``module``'s current parameters, in place.

    Groups, their order and their hyper-parameters are kept.

    Raises:
        ValueError: a parameter of the optimizer is not a parameter of ``module``.
        RuntimeError: the optimizer already holds state for parameters that were replaced.
    """
    current = dict(module.named_parameters(remove_duplicate=False))
    unknown = [p for p in optimizer_parameters(optimizer) if id(p) not in names_before]
    if unknown:
        shapes = ", ".join(str(tuple(p.shape)) for p in unknown[:5])
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(unknown)} parameter(s) that are not parameters of the"
            f" {type(module).__name__} being set up (shapes: {shapes}). Build the optimizer over this"
            " model's parameters: `optimizer = torch.optim.AdamW(model.parameters())`, then"
            " `acc.setup(model, optimizer)`."
        )
    new_groups = [[current[names_before[id(p)]] for p in group["params"]] for group in optimizer.param_groups]
    replaced = any(
        new is not old
        for new_params, group in zip(new_groups, optimizer.param_groups, strict=True)
        for new, old in zip(new_params, group["params"], strict=True)
    )
    if replaced and optimizer.state:
        raise RuntimeError(
            f"{type(optimizer).__name__} already has state (it was stepped before `setup`), and setup"
            " replaced the parameters it refers to. Call `acc.setup(model, optimizer)` before the first"
            " `optimizer.step()`."
        )
    for new_params, group in zip(new_groups, optimizer.param_groups, strict=True):
        group["params"] = new_params
