"""What ``setup`` returns: thin wrappers that route forward and ``step`` through the strategy.

The loader ``setup_dataloaders`` returns lives with the rest of data loading, in :mod:`minifabric.data`.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from minifabric.strategies.strategy import Strategy


#: methods that run through the strategy like ``forward`` without being marked (as in Fabric)
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class _WrappedModule(nn.Module):
    """Runs forward under the precision context, converting inputs and outputs.

    ``training_step``, ``validation_step``, ``test_step``, ``predict_step`` and methods marked with
    :meth:`mark_forward_method` run the same way, through the strategy's forward (so DDP
    synchronizes their gradients, FSDP gathers the parameters, the precision applies). Other
    methods fall through to the user's module, so ``model.config`` or ``model.generate`` still
    work; where such a method runs the model's layers and the strategy or precision would have
    done something in forward, a warning says so, once per method.
    ``state_dict()`` is the user's module's (no wrapper prefixes).
    """

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, strategy: Strategy) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module
        self._strategy = strategy
        self._forward_methods = set(STEP_METHODS)
        self._fsdp_registered: set[str] = set()
        self._warned: set[str] = set()
        # whether calling layers outside forward skips something: DDP, sharding, precision
        self._tracks_methods = (
            forward_module is not original_module
            or strategy.world_size > 1
            or strategy.precision.name != "32-true"
        )

    @property
    def module(self) -> nn.Module:
        """The user's module."""
        return self._original_module

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward synchronizes gradients (DDP's attribute, set by nanoGPT-style accumulation).

        ``model.require_backward_grad_sync = False`` pauses gradient communication until it is set
        to True again, under every strategy, as ``acc.no_backward_sync(model)`` does for a block:
        set it True before the backward of the last micro-batch.

        Example:
            >>> import torch
            >>> from minifabric import Accelerator
            >>> model = Accelerator(accelerator="cpu").setup(torch.nn.Linear(2, 2))
            >>> model.require_backward_grad_sync = False  # micro-batches that only accumulate
            >>> model.require_backward_grad_sync = True  # the last one synchronizes
        """
        return self.__dict__.get("_sync_paused") is None

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"require_backward_grad_sync must be True or False, got {value!r}:"
                " `model.require_backward_grad_sync = (micro_step == accumulation_steps - 1)`."
            )
        paused = self.__dict__.get("_sync_paused")
        if not value and paused is None:
            context = self._strategy.no_backward_sync(self._forward_module, True)
            context.__enter__()
            self.__dict__["_sync_paused"] = context
        elif value and paused is not None:
            del self.__dict__["_sync_paused"]
            paused.__exit__(None, None, None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with self._strategy.forward_context():
            output = self._forward_module(*args, **kwargs)
        return self._guard_backward(precision.convert_output(output))

    def _guard_backward(self, output: Any) -> Any:
        """Make a plain ``loss.backward()`` through ``output`` raise where ``acc.backward`` is required."""
        strategy = self._strategy
        if not strategy.requires_backward_call or not torch.is_grad_enabled():
            return output

        def check(_grad: torch.Tensor) -> None:
            if not strategy.in_backward:
                raise RuntimeError(
                    f'precision="{strategy.precision.name}" with {type(strategy).__name__} runs backward through'
                    " the accelerator, as Lightning Fabric does: replace `loss.backward()` with `acc.backward(loss)`."
                )

        def register(tensor: torch.Tensor) -> None:
            if tensor.requires_grad:
                tensor.register_hook(check)

        apply_to_collection(output, torch.Tensor, register)
        return output

    def mark_forward_method(self, method: str | MethodType) -> None:
        """Run ``method`` of the user's module through the strategy's forward, like ``training_step``.

        Example:
            >>> import torch
            >>> from minifabric import Accelerator
            >>> class Net(torch.nn.Linear):
            ...     def loss(self, x):
            ...         return self(x).pow(2).mean()
            >>> model = Accelerator(accelerator="cpu").setup(Net(2, 2))
            >>> model.mark_forward_method("loss")
            >>> model.loss(torch.ones(1, 2)).ndim
            0
        """
        if not isinstance(method, (str, MethodType)):
            raise TypeError(
                f"mark_forward_method takes a method name or a bound method, got {method!r}:"
                ' `model.mark_forward_method("generate")`.'
            )
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError(
                "`forward` runs through the strategy already; mark other methods, e.g. `generate`."
            )
        if not isinstance(getattr(self._original_module, name, None), MethodType):
            raise ValueError(
                f"mark_forward_method({name!r}): {type(self._original_module).__name__}.{name} is not a method."
            )
        self._forward_methods.add(name)

    def _run_forward_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with self._strategy.forward_context():
            if self._forward_module is self._original_module:
                output = self._call_in_place(name, args, kwargs)
            else:
                output = self._call_through_wrapper(name, args, kwargs)
        return self._guard_backward(precision.convert_output(output))

    def _call_in_place(self, name: str, args: tuple, kwargs: dict) -> Any:
        # The module is its own forward module (one device, or sharded in place by FSDP2): FSDP2
        # runs its forward hooks (gather, cast, reshard) around a method registered with it.
        if name not in self._fsdp_registered:
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(self._original_module, name)  # a no-op unless sharded
            self._fsdp_registered.add(name)
        return getattr(self._original_module, name)(*args, **kwargs)

    def _call_through_wrapper(self, name: str, args: tuple, kwargs: dict) -> Any:
        # The wrapper (DDP) calls `module.forward`: point that at the method for this one call;
        # the method itself sees the real forward again (it may call `self(x)`).
        module = self._original_module
        method = getattr(module, name)
        own_forward = module.__dict__.get("forward")

        def restore() -> None:
            if own_forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own_forward

        def redirected(*a: Any, **k: Any) -> Any:
            restore()
            return method(*a, **k)

        module.forward = redirected
        try:
            return self._forward_module(*args, **kwargs)
        finally:
            restore()

    def _tracked(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``method``, warning once if it runs any of the model's layers (outside the strategy's forward)."""

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            ran: list[bool] = []
            handles = [
                m.register_forward_pre_hook(lambda *_: ran.append(True))
                for m in self._original_module.modules()
            ]
            try:
                return method(*args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()
                if ran and name not in self._warned:
                    self._warned.add(name)
                    cls = type(self._original_module).__name__
                    warnings.warn(
                        f"`{cls}.{name}()` ran the model's layers outside `model(...)`, so what the strategy and"
                        f" precision do in forward (DDP gradient sync, FSDP gathering, {self._strategy.precision.name}"
                        f" casts) did not apply to it. If it computes a loss or should run like forward, mark it"
                        f' after setup: `model.mark_forward_method("{name}")`. (Warned once per method.)',
                        UserWarning,
                        stacklevel=2,
                    )

        return call

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the user's module; full (unsharded) tensors load into a sharded model too.

        Under FSDP the parameters are DTensors, and ``nn.Module.load_state_dict`` refuses plain
        tensors for them. Each full tensor (``torch.load`` of a file, litgpt's ``lazy_load``, read
        on every rank) is cut to this rank's shard first, without communication; a shape that
        differs from the model's raises ``ValueError``, and with ``strict`` a missing or unexpected
        key ``RuntimeError``, before anything is loaded.
        """
        from minifabric.checkpoint.layout import module_state

        module = self._original_module
        return module.load_state_dict(
            module_state(module, state_dict, assign=assign, strict=strict), strict=strict, assign=assign
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        original = super().__getattr__("_original_module")
        if name in self.__dict__.get("_forward_methods", ()) and callable(getattr(original, name, None)):
            return functools.partial(self._run_forward_method, name)
        attr = getattr(original, name)
        if (
            self.__dict__.get("_tracks_methods")
            and inspect.ismethod(attr)
            and name not in self.__dict__["_warned"]
        ):
            return self._tracked(attr, name)
        return attr


class _WrappedOptimizer:
    """Steps through the strategy (gradient scaler, sharded optimizers).

    Subclasses the optimizer's class, so ``isinstance(opt, AdamW)`` holds, and reads ``state``,
    ``param_groups`` and ``defaults`` from the optimizer itself: ``load_state_dict`` replaces those
    objects, and LR schedulers built over either object must keep driving the same groups.
    """

    _SHARED = ("state", "param_groups", "defaults")

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> None:
        skip = ("state_dict", "step", "__del__", *self._SHARED)
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in skip}
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (type(self), type(optimizer)), {})
        self._optimizer = optimizer
        self._strategy = strategy
        self._callbacks = callbacks if callbacks is not None else []  # for on_after_optimizer_step

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer that ``step`` drives."""
        return self._optimizer

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:
        kwargs = {"closure": closure} if closure is not None else {}
        output = self._strategy.optimizer_step(self._optimizer, **kwargs)
        for callback in self._callbacks:  # as Fabric's optimizer does
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=self._strategy, optimizer=self._optimizer)
        return output

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict``; full state of sharded parameters is cut to this rank's shard.

        Saved parameters pair with the live ones by position, as in torch. State that cannot be laid
        out like its sharded parameter, or state keyed by parameter name (whose names position would
        ignore), raises ``ValueError`` before anything is loaded.
        """
        from minifabric.checkpoint.layout import optimizer_state, refuse_named

        refuse_named(state_dict)
        self._optimizer.load_state_dict(optimizer_state(self._optimizer, state_dict))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)
