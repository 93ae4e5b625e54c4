"""The state a replica group sends to a group that rejoins, and how the rejoining group applies it.

Rank ``r`` of a live group sends to rank ``r`` of the group that heals: both shard the model the same
way (same model, same number of processes), so each rank needs only its own shard. What travels is
plain tensors: the local part of every sharded tensor (a DTensor's ``to_local()``) with its layout,
and the receiver rebuilds the DTensors on its own device mesh. Nothing here communicates: building
the state reads tensors in place (no copies) and applying it writes them in place.

The whole payload (:func:`heal_payload`) is the modules' tensors, the optimizers' states and every
registered object's ``state_dict()``; :func:`apply_heal_payload` checks that both groups hold the
same things before it writes any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from minifabric._torch import tree_map
from minifabric.init.place import copy_into_local, shard_from_local
from minifabric.parameters import optimizer_parameters


@dataclass
class LocalShard:
    """One rank's part of a DTensor as it travels: the local tensor and the global layout."""

    tensor: torch.Tensor
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return LocalShard(value.to_local(), tuple(value.placements), value.shape, tuple(value.stride()))
    return value


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by name, each as this rank's local tensor (a view)."""
    return {
        name: tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for name, tensor in module.state_dict().items()
    }


def load_module_state(module: nn.Module, received: dict[str, torch.Tensor]) -> None:
    """Copy ``received`` (from :func:`module_state` on a peer) into ``module``'s tensors in place.

    Raises:
        RuntimeError: the names or shapes differ (the groups do not run the same model).
    """
    live = module.state_dict()
    if set(live) != set(received):
        missing, unexpected = sorted(set(live) - set(received)), sorted(set(received) - set(live))
        raise RuntimeError(
            f"The state received from a live replica group does not match {type(module).__name__}:"
            f" missing {missing}, unexpected {unexpected}. Every replica group must build the same model."
        )
    with torch.no_grad():
        for name, tensor in live.items():
            copy_into_local(
                tensor,
                received[name],
                lambda here, got, name=name: RuntimeError(
                    f"The state received from a live replica group has {name!r} of shape"
                    f" {got} here, but this rank holds {here}. Every replica"
                    " group must build the same model with the same number of processes."
                ),
            )


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor replaced by its :class:`LocalShard` (no copies).

    It carries the optimizer's class name too, which the receiving optimizer must share.
    """
    return {**tree_map(_local, optimizer.state_dict()), "minifabric.type": type(optimizer).__name__}


def load_optimizer_state(optimizer: Optimizer, received: dict[str, Any]) -> None:
    """Load a peer's :func:`optimizer_state` into ``optimizer``, rebuilding DTensors on this rank's mesh.

    A fresh optimizer (never stepped) gets its state created; hyper-parameters (a scheduled learning
    rate) come from the peer too.

    Raises:
        RuntimeError: the peer's optimizer is of another class, or holds another number of parameters.
    """
    sent_type = received.get("minifabric.type", type(optimizer).__name__)
    if sent_type != type(optimizer).__name__:
        raise RuntimeError(
            f"A live replica group sent the state of a {sent_type}; this group steps a"
            f" {type(optimizer).__name__}. Every replica group must build the same optimizers, in the"
            " same order."
        )
    params = optimizer_parameters(optimizer)
    sent = sum(len(group["params"]) for group in received["param_groups"])
    if sent != len(params):
        raise RuntimeError(
            f"A live replica group sent optimizer state for {sent} parameters; this {type(optimizer).__name__}"
            f" has {len(params)}. Every replica group must build the same model and optimizer."
        )

    def rebuild(value: Any, param: torch.Tensor) -> Any:
        if not isinstance(value, LocalShard):
            return value
        if not isinstance(param, DTensor):
            raise RuntimeError(
                "A live replica group sent sharded optimizer state for a parameter that is not sharded"
                " here. Every replica group must use the same strategy and number of processes."
            )
        local = value.tensor.to(param.to_local().device)
        return shard_from_local(local, param.device_mesh, value.placements, value.shape, value.stride)

    state = {
        index: {key: rebuild(value, params[index]) for key, value in entry.items()}
        for index, entry in received["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": received["param_groups"]})


class PrecisionState:
    """A precision's state as a group sends it: with its name, which the receiving group must share.

    Args:
        precision: the strategy's precision (its state is the loss scale of ``"16-mixed"``).
    """

    def __init__(self, precision: Any) -> None:
        self.precision = precision

    def state_dict(self) -> dict[str, Any]:
        """The precision's name and state."""
        return {"name": self.precision.name, "state": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a live group's precision state.

        Raises:
            RuntimeError: the live group trains with another precision.
        """
        if state["name"] != self.precision.name:
            raise RuntimeError(
                f"A live replica group trains with precision={state['name']!r}, this group with"
                f" {self.precision.name!r}: their gradients would be averaged together (scaled or not)."
                f" Every replica group must use the same precision: `Accelerator(precision={state['name']!r})`."
            )
        self.precision.load_state_dict(state["state"])


class GroupSettings:
    """What every group must agree on, sent with the state: a group that heals checks it.

    Args:
        settings: this group's :class:`~minifabric.FaultTolerance` settings.
    """

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def state_dict(self) -> dict[str, int]:
        """This group's number and the number of groups."""
        return {"id": self.settings.replica_group_id, "groups": self.settings.num_replica_groups}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Check a live group's settings against this group's.

        Raises:
            RuntimeError: another ``num_replica_groups``, or this group's own ``replica_group_id``.
        """
        here = self.settings
        if state["groups"] != here.num_replica_groups:
            raise RuntimeError(
                f"A live replica group runs with num_replica_groups={state['groups']}, this group with"
                f" {here.num_replica_groups}: they would split the data differently (some samples read"
                " twice, some never). Start every group with the same"
                f" `FaultTolerance(..., num_replica_groups={state['groups']})`."
            )
        if state["id"] == here.replica_group_id:
            raise RuntimeError(
                f"Two replica groups run with replica_group_id={here.replica_group_id}: they would read the"
                " same part of the data. Give each group its own number, from 0 to"
                f" {here.num_replica_groups - 1}: `FaultTolerance(replica_group_id=..., ...)`."
            )


def heal_payload(
    module_views: list[dict[str, torch.Tensor]], optimizers: list[Optimizer], objects: dict[str, Any]
) -> dict[str, Any]:
    """What a live group sends: the modules' tensors (``module_views``, from :func:`module_state`),
    the optimizers' states and the registered objects' states."""
    return {
        "modules": module_views,
        "optimizers": [optimizer_state(o) for o in optimizers],
        "objects": {name: obj.state_dict() for name, obj in objects.items()},
    }


def apply_heal_payload(
    state: dict[str, Any], modules: list[nn.Module], optimizers: list[Optimizer], objects: dict[str, Any]
) -> None:
    """Load a live group's :func:`heal_payload` into this group's modules, optimizers and objects.

    Raises:
        RuntimeError: the live group holds other numbers of modules or optimizers, or other
            registered objects (checked before anything is written), or their contents differ.
    """
    sent = (len(state["modules"]), len(state["optimizers"]), sorted(state["objects"]))
    here = (len(modules), len(optimizers), sorted(objects))
    if sent != here:
        raise RuntimeError(
            f"A live replica group sent (modules, optimizers, registered objects) = {sent}, but this"
            f" group has {here}. Every replica group must set up the same models and optimizers and"
            " register the same objects."
        )
    for module, received in zip(modules, state["modules"], strict=True):
        load_module_state(module, received)
    for optimizer, received in zip(optimizers, state["optimizers"], strict=True):
        load_optimizer_state(optimizer, received)
    for name, obj in objects.items():
        obj.load_state_dict(state["objects"][name])
