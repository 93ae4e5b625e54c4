"""``acc.init_module()``'s side of a strategy: the device and dtype a model is built in, meta init's
recording (:func:`minifabric.init.meta_init_context`) with where this rank's parts will live, and
:func:`wrap`, which model code calls inside the block to shard a piece with the strategy's settings.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from torch import nn

from minifabric.init import meta_init_context

if TYPE_CHECKING:
    from minifabric.strategies.strategy import Strategy

_ACTIVE_INIT: ContextVar[Strategy | None] = ContextVar("minifabric_active_init", default=None)


@contextmanager
def module_init_context(strategy: Strategy, empty_init: bool, verify: bool) -> Generator[None, None, None]:
    """Where and in which dtype ``init_module`` creates a model under ``strategy`` (``Strategy.module_init_context``).
    Inside, :func:`wrap` shards with the strategy's settings."""
    # Meta init records on the device eager construction would use: the same random streams.
    device = strategy.root_device
    token = _ACTIVE_INIT.set(strategy)
    try:
        with strategy.precision.tensor_init_context(), device:
            if empty_init:
                with meta_init_context(
                    verify=verify, keep=strategy.meta_init_part(), device=device, keep_on=strategy.parameter_device
                ):
                    yield
            else:
                yield
    finally:
        _ACTIVE_INIT.reset(token)


def wrap(module: nn.Module) -> nn.Module:
    """Shard ``module`` with the FSDP settings of the enclosing ``acc.init_module()``; return it.

    Outside ``init_module``, or under any strategy other than FSDP, this returns ``module``
    unchanged, so the same model code runs everywhere.

    Example:
        >>> import torch
        >>> from minifabric import wrap
        >>> layer = wrap(torch.nn.Linear(4, 4))  # no-op outside acc.init_module()
    """
    strategy = _ACTIVE_INIT.get()
    return strategy.wrap(module) if strategy is not None else module
