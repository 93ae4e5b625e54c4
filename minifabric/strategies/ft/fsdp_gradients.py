"""Where a replica group reaches FSDP2's gradients: each sharding unit's all-reduce hook.

The one FSDP-specific part of fault tolerance. :class:`FSDPGradients` hands each unit's flat
reduce-scattered gradient to the replica group (which averages it with the other live groups) and
tells whether FSDP reads that buffer right after the hook (then its all-reduce is waited for at
once). Another strategy gives the component its own object with the same two methods (see
:class:`~minifabric.strategies.ft.component.GradientHooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn


class FSDPGradients:
    """FSDP2's gradient hooks, as a replica group uses them (see :class:`~minifabric.strategies.ft.component.GradientHooks`)."""

    def attach(self, module: nn.Module, average: Callable[[list[nn.Parameter], torch.Tensor], None]) -> None:
        """Call ``average(params, shard)`` with each sharding unit's reduce-scattered gradient in backward.

        Raises:
            RuntimeError: ``module`` has no FSDP2 sharding unit (nothing would be averaged).
        """
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise RuntimeError(
                f"{type(module).__name__} has no FSDP sharding unit, so its gradients would never be"
                " averaged across replica groups. Set it up with `FSDPStrategy(fault_tolerance=...)`."
            )
        for unit in units:
            unit.set_all_reduce_hook(partial(average, _own_parameters(unit)))

    def defers(self, shard: torch.Tensor, params: list[nn.Parameter]) -> bool:
        """Whether FSDP makes ``shard`` the gradients as it is (views), so its all-reduce may finish later.

        FSDP2 reads the buffer right after the hook when it casts it to the parameters' dtype, divides
        it after the reduction (reduce dtypes other than float32/bfloat16), or adds it into gradients
        an earlier backward left; only CPU buffers are deferred (no streams to order).
        """
        return (
            shard.device.type == "cpu"
            and shard.dtype in (torch.float32, torch.bfloat16)
            and all(p.dtype == shard.dtype and p.grad is None for p in params)
        )


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP reduces in ``unit``'s hook: its own, not those of sharding units inside it."""
    from torch.distributed.fsdp import FSDPModule

    inner = {
        id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in inner]
