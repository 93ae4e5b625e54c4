"""What ``setup`` returns: thin wrappers that route forward, ``step`` and iteration through the strategy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from minifabric.strategies.strategy import Strategy


class _WrappedModule(nn.Module):
    """Runs forward under the precision context, converting inputs and outputs.

    Attribute access falls through to the user's module, so ``model.config`` or ``model.generate``
    still work. ``state_dict()`` is the user's module's (no wrapper prefixes).
    """

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, strategy: Strategy) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module
        self._strategy = strategy

    @property
    def module(self) -> nn.Module:
        """The user's module."""
        return self._original_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with self._strategy.forward_context():
            output = self._forward_module(*args, **kwargs)
        return precision.convert_output(output)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._original_module, name)


class _WrappedOptimizer:
    """Steps through the strategy (gradient scaler, sharded optimizers).

    Shares the optimizer's ``__dict__`` and subclasses its class, so ``isinstance(opt, AdamW)``
    holds and LR schedulers built over either object drive the same parameter groups.
    """

    def __init__(self, optimizer: Optimizer, strategy: Strategy) -> None:
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("state_dict", "step", "__del__")}
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (type(self), type(optimizer)), {})
        self._optimizer = optimizer
        self._strategy = strategy

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer that ``step`` drives."""
        return self._optimizer

    def step(self, closure: Any = None) -> Any:
        kwargs = {"closure": closure} if closure is not None else {}
        return self._strategy.optimizer_step(self._optimizer, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


class _WrappedDataLoader:
    """Moves batches to the device and sets the sampler's epoch at the start of every pass.

    ``state_dict()``/``load_state_dict()`` record the epoch and the batches already consumed, so a
    run restored from a checkpoint continues at the next unseen batch.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device | None) -> None:
        self._dataloader = dataloader
        self._device = device
        self._epoch = 0
        self._batches_seen = 0
        self._skip = 0

    @property
    def dataloader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self._dataloader

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self._dataloader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)
        skip, self._skip = self._skip, 0
        if skip and hasattr(sampler, "start_index"):
            sampler.start_index = skip * (self._dataloader.batch_size or 1)
        elif skip:
            raise RuntimeError(
                "This dataloader cannot resume mid-epoch: its sampler was not set up by minifabric."
                " Use `acc.setup_dataloaders(loader)` (with use_distributed_sampler=True)."
            )
        self._batches_seen = skip
        for batch in self._dataloader:
            self._batches_seen += 1
            yield move_data_to_device(batch, self._device) if self._device is not None else batch
        self._epoch += 1
        self._batches_seen = 0

    def state_dict(self) -> dict[str, Any]:
        """Epoch and batches consumed in it: where iteration resumes after a restore."""
        state: dict[str, Any] = {"epoch": self._epoch, "batches_seen": self._batches_seen}
        generator = getattr(self._dataloader, "generator", None)
        if generator is not None:
            state["generator"] = generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next ``iter()``."""
        self._epoch = int(state_dict["epoch"])
        self._skip = int(state_dict["batches_seen"])
        generator = getattr(self._dataloader, "generator", None)
        if generator is not None and "generator" in state_dict:
            generator.set_state(state_dict["generator"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dataloader, name)
