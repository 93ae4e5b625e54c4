"""Checks and conversions of what users pass to the Accelerator's methods."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from minifabric._torch import track_scheduler_steps
from minifabric.data import _WrappedDataLoader
from minifabric.init import has_meta_tensors, verify_requested
from minifabric.wrappers import _WrappedModule, _WrappedOptimizer


class CallWithAccelerator:
    """A picklable ``fn(acc, *args)`` for spawned processes.

    As in Fabric, ``DataLoader`` (and ``BatchSampler``) subclasses created while ``fn`` runs record
    their ``__init__`` arguments, so ``setup_dataloaders`` can rebuild one with a distributed sampler
    even when its ``__init__`` takes arguments that it does not keep as attributes (with several
    processes: with one, no loader is rebuilt).
    """

    def __init__(self, accelerator: Any, function: Callable[..., Any]) -> None:
        self.accelerator = accelerator
        self.function = function

    def __call__(self, *args: Any) -> Any:
        if self.accelerator.world_size == 1:  # no sampler to inject: skip lightning's import (~1 s)
            return self.function(self.accelerator, *args)
        from lightning_fabric.utilities.data import _replace_dunder_methods
        from torch.utils.data import BatchSampler, DataLoader

        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            return self.function(self.accelerator, *args)


def check_launch_function(function: Any, args: tuple, spawn_only: bool) -> None:
    """Refuse, before any process starts, a ``launch`` target that cannot be called as ``fn(acc, *args)``.

    Args:
        function: what was passed to ``launch`` (None: re-run the script).
        args: the arguments that follow the accelerator.
        spawn_only: the strategy starts processes only by calling a function (``"ddp_spawn"``).
    """
    if function is None:
        if spawn_only:
            raise TypeError(
                'strategy="ddp_spawn" starts processes that run a function: call `acc.launch(train)`'
                ' with `def train(acc): ...`, or use strategy="ddp" to re-run the script with `acc.launch()`.'
            )
        return
    if not callable(function):
        raise TypeError(
            f"`acc.launch(function)` needs a callable, got {function!r}. Example: `acc.launch(train)`"
            " (not `acc.launch(train())`)."
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(None, *args)
    except TypeError as err:
        raise TypeError(
            f"`acc.launch({getattr(function, '__name__', function)!r}, ...)` calls it as fn(acc, *args) with"
            f" {len(args)} more argument(s), which its signature {signature} does not take ({err}). The"
            " accelerator comes first: `def train(acc, ...): ...`."
        ) from None


def launch_needed(num_processes: int) -> str:
    """The message of a call that needs the processes ``launch()`` starts."""
    return (
        f"This run needs {num_processes} processes, but none were started. Call `acc.launch()` right after"
        f" creating the Accelerator (or start the script with `minifabric run --devices {num_processes} script.py`)."
    )


def check_module(module: Any) -> None:
    """``setup``'s model: a module, not what ``setup`` returned (a ``ValueError``, as in Fabric)."""
    if isinstance(module, _WrappedModule):
        raise ValueError(
            f"This {type(module.module).__name__} was already set up: pass the original module, or keep"
            " using what `acc.setup` returned."
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"`acc.setup` needs a torch.nn.Module first, got {type(module).__name__}.")


def check_optimizers(optimizers: tuple) -> None:
    """``setup_optimizers``'s arguments: at least one, each an optimizer not set up already."""
    if not optimizers:
        raise ValueError("`acc.setup_optimizers()` needs at least one optimizer.")
    for optimizer in optimizers:
        if isinstance(optimizer, _WrappedOptimizer):
            raise ValueError(
                f"This {type(optimizer.optimizer).__name__} was already set up; keep using what `acc.setup` returned."
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")


def check_scheduler(scheduler: Any) -> None:
    """``setup(model, scheduler=...)`` without an optimizer: the scheduler has nothing to drive."""
    if scheduler is not None:
        raise ValueError("`scheduler=` needs an optimizer: `acc.setup(model, optimizer, scheduler=sched)`.")


def check_clip(clip_val: Any, max_norm: Any) -> None:
    """``clip_gradients`` clips by value or by norm: exactly one of the two."""
    if (max_norm is None) == (clip_val is None):
        raise ValueError(
            f"Pass exactly one of clip_val={clip_val!r} and max_norm={max_norm!r}, e.g."
            " `acc.clip_gradients(model, optimizer, max_norm=1.0)`."
        )


def check_dataloaders(dataloaders: tuple) -> None:
    """``setup_dataloaders``'s arguments: at least one, each a ``DataLoader`` not set up already."""
    from torch.utils.data import DataLoader

    if not dataloaders:
        raise ValueError("`acc.setup_dataloaders()` needs at least one DataLoader.")
    for loader in dataloaders:
        if isinstance(loader, _WrappedDataLoader):
            raise ValueError(
                "This DataLoader was already set up by `acc.setup_dataloaders`; keep using what it returned."
            )
        if not isinstance(loader, DataLoader):
            raise TypeError(f"Expected a torch.utils.data.DataLoader, got {type(loader).__name__}.")


def point_scheduler_at(scheduler: Any, optimizer: Any) -> None:
    """Make ``scheduler`` drive ``optimizer`` (the optimizer ``setup`` returned)."""
    track_scheduler_steps(scheduler, optimizer)


def unwrap_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the objects ``setup`` returned replaced by the user's module and optimizer."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, _WrappedModule):
            value = value.module
        elif isinstance(value, _WrappedOptimizer):
            value = value.optimizer
        out[key] = value
    return out


def check_state(state: Any, keep_last: Any = None) -> None:
    """Validate a ``state`` dict passed to ``save``/``load`` (and ``save``'s ``keep_last``)."""
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        raise ValueError(
            f"keep_last must be a positive int or None, got {keep_last!r}; e.g. `acc.save(path, state, keep_last=3)`."
        )
    if not isinstance(state, dict):
        raise TypeError(
            f"state must be a dict of names to objects, got {type(state).__name__}. Example:"
            ' `acc.save(path, {"model": model, "optimizer": optimizer, "step": step})`.'
        )
    for key in state:
        if not isinstance(key, str):
            raise TypeError(f"state keys must be strings, got {key!r}.")
    for key, value in state.items():
        if isinstance(value, nn.Module) and has_meta_tensors(value):
            raise RuntimeError(
                f"state[{key!r}] still has meta parameters: call `acc.setup(model)` before saving it."
            )


def safetensors_module(state: dict[str, Any], format: Any, asynchronous: bool) -> nn.Module | None:
    """``save``'s ``format=``: the one module to write as safetensors, or None for a checkpoint."""
    if format == "minifabric":
        return None
    if format != "safetensors":
        raise ValueError(f'format={format!r} is unknown. Use "minifabric" (a checkpoint) or "safetensors".')
    modules = [value for value in state.values() if isinstance(value, nn.Module)]
    if len(modules) != 1 or len(state) != 1:
        raise ValueError(
            f'format="safetensors" writes one model\'s weights; state has {sorted(state)}. Save the model'
            ' alone: `acc.save(path, {"model": model}, format="safetensors")`.'
        )
    if asynchronous:
        raise ValueError('format="safetensors" does not write asynchronously; pass `asynchronous=False`.')
    return unwrap_state({"m": modules[0]})["m"]


def check_init_module_arguments(empty_init: bool | None, verify: bool | None) -> bool:
    """Whether ``init_module(empty_init, verify=verify)`` runs the meta-init self-check."""
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(
            f"verify must be True, False or None, got {verify!r};"
            " e.g. `acc.init_module(empty_init=True, verify=True)`."
        )
    if verify and not empty_init:
        raise ValueError(
            f"verify=True checks meta-device init, but empty_init={empty_init!r}: use"
            " `acc.init_module(empty_init=True, verify=True)`."
        )
    return bool(empty_init) and verify_requested(verify)
