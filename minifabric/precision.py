"""Precision plugins: how parameters are stored, how forward runs, how gradients are scaled.

Three small classes cover the six precision strings:

- `Precision` (``"32-true"``): nothing to do.
- `TruePrecision` (``"64-true"``, ``"bf16-true"``, ``"16-true"``): parameters, inputs and
  new tensors all live in one dtype.
- `MixedPrecision` (``"bf16-mixed"``, ``"16-mixed"``): float32 parameters, floating-point inputs cast
  to the compute dtype and forward under ``torch.autocast``; ``"16-mixed"`` adds a gradient scaler so small fp16 gradients do not flush to zero.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric._torch import default_dtype as _default_dtype
from minifabric._torch import tree_map

PrecisionStr = Literal["32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionStr)
#: what ``Accelerator(precision=...)`` accepts: the strings above and Lightning Fabric's aliases
PrecisionInput = PrecisionStr | Literal[16, 32, 64, "16", "32", "64", "bf16"]


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, data
    )


class Precision:
    """Full float32 precision (``"32-true"``); the base class of the other plugins.

    Every hook is a no-op here. Subclasses override what their precision changes.
    """

    name: str = "32-true"
    #: dtype of the parameters as stored (and of tensors made in ``init_module``/``init_tensor``).
    param_dtype: torch.dtype = torch.float32
    #: dtype that forward computes in.
    compute_dtype: torch.dtype = torch.float32
    #: whether parameters stay float32 while compute runs in ``compute_dtype``.
    is_mixed: bool = False

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert a module's parameters and buffers to the stored dtype."""
        return module

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        """Tensors created inside get the stored dtype."""
        with _default_dtype(self.param_dtype):
            yield

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The context ``model.forward`` runs in."""
        yield

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs to what forward expects."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs back to float32."""
        return data

    def pre_backward(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return the tensor to call ``.backward()`` on (scaled for fp16 mixed precision)."""
        return tensor

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Undo loss scaling on the optimizer's gradients (before clipping them)."""

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step the optimizer (through the gradient scaler when there is one)."""
        return optimizer.step(**kwargs)

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (the gradient scaler's)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][minifabric.Precision.state_dict] returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class TruePrecision(Precision):
    """Everything stored and computed in one dtype: ``"64-true"``, ``"bf16-true"``, ``"16-true"``."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.param_dtype = self.compute_dtype = dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        floating = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
        if all(t.dtype == self.param_dtype for t in floating):
            # built in `init_module` (or converted) already: nothing to cast. torch cannot cast the
            # parameters of a model under FakeTensorMode, which `estimate_memory` builds in this dtype.
            return module
        if self.param_dtype == torch.float64:
            return (
                module.double()
            )  # as Fabric: complex tensors stay complex (``.to(float64)`` drops the imaginary part)
        return module.to(dtype=self.param_dtype)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with _default_dtype(self.param_dtype):
            yield

    def convert_input(self, data: Any) -> Any:
        return _cast_floats(data, self.param_dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floats(data, torch.get_default_dtype())


class MixedPrecision(Precision):
    """float32 parameters, forward under ``torch.autocast``: ``"bf16-mixed"`` and ``"16-mixed"``.

    ``"16-mixed"`` uses a `torch.amp.GradScaler`: the loss is scaled before backward, gradients
    are unscaled before clipping and before the step, and a step whose gradients hold an inf or NaN
    is skipped (the scale is then lowered). A step whose gradients did not come from
    ``acc.backward(loss)`` (a plain ``loss.backward()``) raises instead of stepping with gradients
    that were never scaled.

    Args:
        name: ``"bf16-mixed"`` or ``"16-mixed"``.
        dtype: the dtype forward computes in.
        device_type: ``"cpu"`` or ``"cuda"``, for ``torch.autocast``.
    """

    is_mixed = True

    def __init__(self, name: str, dtype: torch.dtype, device_type: str) -> None:
        self.name = name
        self.compute_dtype = dtype
        self.device_type = device_type
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device_type) if dtype == torch.float16 else None
        )
        # ids of the optimizers stepped since the last scaled backward (None before the first one):
        # stepping one again means its gradients came from a plain `loss.backward()`
        self._stepped: set[int] | None = None

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        yield

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            yield

    def convert_input(self, data: Any) -> Any:
        # as Fabric: floating-point inputs enter forward in the compute dtype, so ops that autocast
        # leaves alone (elementwise, custom) run in it too
        return _cast_floats(data, self.compute_dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floats(data, torch.get_default_dtype())

    def pre_backward(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return tensor
        self._stepped = set()
        return self.scaler.scale(tensor)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if self._stepped is None or id(optimizer) in self._stepped:
            raise RuntimeError(
                f'precision="{self.name}" scales the loss in `acc.backward(loss)`, but this'
                f" {type(optimizer).__name__}.step() follows no `acc.backward(...)` since its last step"
                " (a plain `loss.backward()`?). Replace `loss.backward()` with `acc.backward(loss)`."
            )
        self._stepped.add(id(optimizer))
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])


_TRUE_DTYPES = MappingProxyType({"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16})
_MIXED_DTYPES = MappingProxyType({"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16})


def precision_from_string(name: str, device_type: str) -> Precision:
    """Build the plugin for a precision string.

    Example:
        >>> precision_from_string("bf16-mixed", "cpu")
        MixedPrecision('bf16-mixed')
    """
    if name == "32-true":
        return Precision()
    if name in _TRUE_DTYPES:
        return TruePrecision(name, _TRUE_DTYPES[name])
    if name in _MIXED_DTYPES:
        return MixedPrecision(name, _MIXED_DTYPES[name], device_type)
    raise ValueError(
        f"Unknown precision={name!r}. Choose one of {', '.join(map(repr, PRECISIONS))},"
        f' e.g. Accelerator(precision="bf16-mixed").'
    )
