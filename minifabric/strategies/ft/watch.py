"""The checks a replica group makes on what the strategy hands it to watch (set-up time, or a step).

Each refuses what could not be averaged across groups or copied to a group that rejoins, with the
set-up call that fixes it; none of them communicates.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer


def _parameter_ids(modules: list[nn.Module]) -> set[int]:
    return {id(p) for module in modules for p in module.parameters()}


def check_step_is_watched(
    optimizer: Optimizer, modules: list[nn.Module], optimizers: list[Optimizer]
) -> None:
    """Before any optimizer's step: one that was not set up must not step a watched model.

    Its step would never commit (so no later step would ask for a quorum, and a group that
    died or rejoined would go unnoticed) and its state would not be healed.

    Raises:
        RuntimeError: ``optimizer`` is not in ``optimizers`` and steps parameters of ``modules``.
    """
    if any(optimizer is watched for watched in optimizers):
        return
    ours = _parameter_ids(modules)
    if any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            f"This {type(optimizer).__name__} steps the parameters of a model set up with"
            " fault_tolerance, but it was not set up: its steps would not commit across replica"
            " groups nor be copied to a group that rejoins. Set it up before the loop:"
            " `optimizer = acc.setup_optimizers(optimizer)`."
        )


def check_optimizer_parameters(optimizer: Optimizer, modules: list[nn.Module]) -> None:
    """Refuse an optimizer that holds parameters of none of the watched ``modules``.

    Raises:
        ValueError: such parameters' gradients would never be averaged across groups, nor their
            values healed.
    """
    ours = _parameter_ids(modules)
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in ours]
    if foreign:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(foreign)} parameter(s) of no model set up with"
            f" fault_tolerance (shapes: {', '.join(str(tuple(p.shape)) for p in foreign[:4])}): their"
            " gradients would not be averaged across replica groups, so the groups would drift"
            " apart. Set up every model the optimizer steps first: `model = acc.setup(model)`, then"
            " `optimizer = acc.setup_optimizers(optimizer)` (or `acc.setup(model, optimizer)`)."
        )


def loader_is_positioned(dataloader: Any) -> bool:
    """Whether a group that rejoins can take the live groups' position in ``dataloader``.

    False for a loader whose position cannot be saved (over an ``IterableDataset``).

    Raises:
        ValueError: ``dataloader`` reads a map-style dataset through a sampler of the user's own
            (``use_distributed_sampler=False``): a group that rejoins mid-epoch could not take the
            live groups' position.
    """
    try:
        dataloader.state_dict()
        positioned = True
    except (TypeError, ValueError, RuntimeError):
        positioned = False
    sampler = getattr(dataloader, "sampler", None)
    if positioned and not hasattr(sampler, "resume"):
        raise ValueError(
            f"This DataLoader reads its data through a sampler of your own ({type(sampler).__name__}):"
            " a replica group that rejoins mid-epoch could not take the live groups' position in"
            " it (it would raise then), and the data is not split across groups. Let minifabric"
            " split and position it: `acc.setup_dataloaders(loader)` (use_distributed_sampler=True)."
        )
    return positioned
