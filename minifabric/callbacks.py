"""Callbacks and loggers as Lightning Fabric has them: ``Accelerator(callbacks=..., loggers=...)``.

A callback is any object; ``acc.call("hook_name", ...)`` invokes the method of that name on every
callback that has one. A logger is any object with ``log_metrics(metrics, step)``, e.g.
lightning-fabric's own ``CSVLogger`` or ``TensorBoardLogger``; minifabric calls it from global
rank 0 only.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch


def as_list(value: Any, name: str) -> list[Any]:
    """``None`` -> ``[]``, one object -> ``[object]``, a list or tuple -> a new list."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, Mapping)):
        example = "MyCallback()" if name == "callbacks" else 'CSVLogger("logs")'
        raise TypeError(
            f"{name}= takes an object or a list of objects, got {value!r}, e.g. `Accelerator({name}=[{example}])`."
        )
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_loggers(loggers: list[Any]) -> None:
    """Every logger must have a callable ``log_metrics``."""
    for logger in loggers:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(
                f"loggers= takes objects with a `log_metrics(metrics, step)` method, got {logger!r}. Use"
                ' e.g. `from lightning_fabric.loggers import CSVLogger; Accelerator(loggers=CSVLogger("logs"))`.'
            )


def first_logger(loggers: list[Any]) -> Any:
    """The first logger (``acc.logger``); raises with the fix when there is none."""
    if not loggers:
        raise RuntimeError(
            'No logger was given: `Accelerator(loggers=CSVLogger("logs"))`'
            " (from lightning_fabric.loggers import CSVLogger)."
        )
    return loggers[0]


def _accepted_kwargs(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``method`` accepts (all of them if it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {k: v for k, v in kwargs.items() if k in names}


def call_hook(callbacks: list[Any], hook_name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``hook_name`` on every callback that has it, in order.

    Keyword arguments a hook does not take are left out (as Fabric does), so callbacks may have
    different signatures for the same hook.
    """
    if not isinstance(hook_name, str):
        raise TypeError(
            f'hook_name must be a string, got {hook_name!r}: `acc.call("on_train_epoch_end", ...)`.'
        )
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            warnings.warn(
                f"Skipping `{type(callback).__name__}.{hook_name}`: it is not callable.",
                UserWarning,
                stacklevel=3,
            )
            continue
        method(*args, **_accepted_kwargs(method, kwargs))


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"acc.log needs scalars, got a tensor of shape {tuple(value.shape)}. Log a reduction,"
                ' e.g. `acc.log("loss", loss.mean())`.'
            )
        return value.item()
    return value


def log_metrics(
    loggers: list[Any], is_global_zero: bool, metrics: Mapping[str, Any], step: int | None
) -> None:
    """Send ``metrics`` (tensors as Python numbers) to every logger, from global rank 0 only."""
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f'metrics must be a dict of names to values, got {metrics!r}: `acc.log_dict({{"loss": loss}})`.'
        )
    if not is_global_zero or not loggers:
        return
    scalars = {name: _scalar(value) for name, value in metrics.items()}
    for logger in loggers:
        logger.log_metrics(metrics=scalars, step=step)
