"""Rebinding an optimizer built before ``setup`` to the parameters ``setup`` produced.

Materializing meta parameters or sharding replaces parameter objects; an optimizer created earlier
would keep stepping the old ones and train nothing. Parameters are matched by their qualified name,
which ``to_empty`` and ``fully_shard`` both preserve. An optimizer that is never passed to ``setup``
cannot be rebound: `OrphanWatch` makes its first ``step()`` raise instead.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric._torch import laid_out_like, register_global_step_pre_hook
from minifabric.parameters import optimizer_parameters

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to its first qualified name in ``module``."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), _clean(name))
    return names


#: ``id(parameter)`` -> (its first qualified name, the parameter), taken before ``setup`` and held
#: only until :meth:`SetupLedger.record`
Before = dict[int, tuple[str, nn.Parameter]]
#: what the ledger keeps of it: the name, and a weak reference to an original that ``setup``
#: replaced (None for one the model still holds)
Originals = dict[int, tuple[str, "weakref.ref[nn.Parameter] | None"]]


def parameters_before(module: nn.Module) -> Before:
    """``module``'s parameters before ``setup`` replaces them (pass them to :meth:`SetupLedger.record`)."""
    before: Before = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        before.setdefault(id(param), (_clean(name), param))
    return before


def _live_names(originals: Originals, module: nn.Module) -> dict[int, str]:
    """The names of the originals that are still alive, by id.

    Python reuses the ids of freed objects: a parameter made after ``setup`` may have the id of an
    original that ``setup`` replaced and freed, and must not be taken for it. An id counts only
    while its original is alive: a replaced one through its weak reference, a kept one as a
    parameter of the model. (Weak references are never taken on a model's own parameters: torch's
    ``swap_tensors`` refuses a tensor that has one.)
    """
    current = {id(p) for p in module.parameters()}
    return {
        key: name
        for key, (name, ref) in originals.items()
        if (key in current if ref is None else ref() is not None)
    }


def _clean(name: str) -> str:
    """``name`` without the component torch's ``checkpoint_wrapper`` inserts (a parallelize_fn may add it)."""
    return name.replace(_CHECKPOINT_WRAPPED, "")


def rebind_optimizer(optimizer: Optimizer, names_before: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s parameter groups at ``module``'s current parameters, in place.

    Groups, their order and their hyper-parameters are kept.

    Raises:
        ValueError: a parameter of the optimizer is not a parameter of ``module``.
        RuntimeError: the optimizer holds state for a replaced parameter that cannot be laid out like it.
    """
    current = {_clean(name): p for name, p in module.named_parameters(remove_duplicate=False)}
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
    pairs = [
        (old, new)
        for new_params, group in zip(new_groups, optimizer.param_groups, strict=True)
        for new, old in zip(new_params, group["params"], strict=True)
        if new is not old and old in optimizer.state
    ]
    moved = {id(old): _state_for(optimizer, old, new) for old, new in pairs}  # all checked before any move
    for old, new in pairs:
        del optimizer.state[old]
        optimizer.state[new] = moved[id(old)]
    for new_params, group in zip(new_groups, optimizer.param_groups, strict=True):
        group["params"] = new_params


def _state_for(optimizer: Optimizer, old: nn.Parameter, new: nn.Parameter) -> dict[str, Any]:
    """The state ``optimizer`` holds for ``old``, laid out like ``new`` (each rank keeps its part).

    Optimizers such as Adagrad create state in their constructor, and one stepped before ``setup``
    has more. A state tensor shaped like the parameter is cut like the parameter; any other tensor
    but a scalar cannot be laid out like it and is refused, as is state on the meta device.
    """
    out = {}
    name = type(optimizer).__name__
    fix = (
        " Create the optimizer after setup: `model = acc.setup(model)`, then"
        f" `optimizer = acc.setup_optimizers({name}(model.parameters(), ...))`."
    )
    for key, value in optimizer.state[old].items():
        if isinstance(value, torch.Tensor) and (value.dim() > 0 or value.is_meta):  # not a scalar step
            if value.is_meta or tuple(value.shape) != tuple(old.shape):
                raise RuntimeError(
                    f"{name} holds state {key!r} of shape {tuple(value.shape)}"
                    f"{' on the meta device' if value.is_meta else ''} for a parameter of shape"
                    f" {tuple(old.shape)} that setup replaced, and it cannot be laid out like the new one."
                    + fix
                )
            if value.is_floating_point() and new.is_floating_point() and value.dtype != new.dtype:
                raise RuntimeError(
                    f"{name} holds state {key!r} in {value.dtype} for a parameter that setup made"
                    f" {new.dtype} (the precision setting), and the optimizer's step would mix them." + fix
                )
            value = laid_out_like(value, new)
        out[key] = value
    return out


class SetupLedger:
    """The models set up so far, to find (and rebind) the model an optimizer belongs to.

    Each entry keeps the parameter names as they were before ``setup`` replaced the parameters, so
    an optimizer built over the originals (even meta ones) is matched by name. Models are held
    weakly: a model the user dropped is freed (its GPU memory too), and its entry with it.
    """

    def __init__(self) -> None:
        # (the originals of its parameters, the model, what its forward calls), the last two held weakly
        self._setups: list[tuple[Originals, weakref.ref[nn.Module], weakref.ref[nn.Module]]] = []

    def record(self, before: Before, module: nn.Module, forward_module: nn.Module) -> None:
        """Remember ``module``, set up just now, with its parameters from before ``setup`` (:func:`parameters_before`)."""
        current = {id(p) for p in module.parameters()}
        originals: Originals = {
            key: (name, None if key in current else weakref.ref(param)) for key, (name, param) in before.items()
        }
        self._setups = [entry for entry in self._setups if entry[1]() not in (None, module)]
        self._setups.append((originals, weakref.ref(module), weakref.ref(forward_module)))

    def _live(self) -> list[tuple[Originals, nn.Module, nn.Module | None]]:
        """The entries whose model is alive, in order (dropping the others)."""
        self._setups = [entry for entry in self._setups if entry[1]() is not None]
        return [(before, module(), forward()) for before, module, forward in self._setups]  # type: ignore[misc]

    def modules(self) -> list[nn.Module]:
        """The models set up so far and still alive, in order."""
        return [module for _, module, _ in self._live()]

    def forward_module(self, module: nn.Module) -> nn.Module | None:
        """What ``setup`` made of ``module`` (None if it was not set up here, or that is gone)."""
        for _, recorded, forward in self._live():
            if recorded is module:
                return forward
        return None

    def check_owned(self, optimizers: tuple, module: nn.Module) -> None:
        """Raise unless each optimizer passed together with ``module`` holds some of its parameters."""
        for before, recorded, _ in self._live():
            if recorded is not module:
                continue
            known = _live_names(before, module).keys() | {id(p) for p in module.parameters()}
            for optimizer in optimizers:
                if (
                    isinstance(optimizer, Optimizer)
                    and not {id(p) for p in optimizer_parameters(optimizer)} & known
                ):
                    raise ValueError(
                        f"{type(optimizer).__name__} holds no parameter of the {type(module).__name__} it is set"
                        " up with. Build it over the model's parameters: `torch.optim.AdamW(model.parameters())`."
                    )

    def rebind(self, optimizer: Optimizer) -> None:
        """Point ``optimizer`` at the set-up parameters of the model it was built over.

        An optimizer over parameters of no model set up here is left as it is, as Fabric's
        ``setup_optimizers`` leaves it (if ``setup`` replaces those parameters later, its first
        ``step()`` raises: see :class:`OrphanWatch`).
        """
        ids = {id(p) for p in optimizer_parameters(optimizer)}
        for before, module, _ in reversed(self._live()):
            names = _live_names(before, module)  # a freed original's id may now be another parameter's
            if ids & names.keys() or ids & {id(p) for p in module.parameters()}:
                names = {**names, **{id(p): _clean(n) for n, p in module.named_parameters()}}
                rebind_optimizer(optimizer, names, module)
                return


class OrphanWatch:
    """Raise at ``step()`` of an optimizer that still holds parameters ``setup`` replaced.

    ``model = acc.setup(model)`` under FSDP (or after ``init_module(empty_init=True)``) gives the
    model new parameter objects. An optimizer built before and never passed to ``setup`` would step
    the old ones: the run finishes, and the model never changed. While any replaced parameter is
    alive (only such an optimizer, or the user, can still hold it), a process-wide optimizer step
    pre-hook checks each optimizer before its step; once the last one is freed (the optimizer was
    set up and rebound, or dropped), the hook is removed. Optimizers found clean are remembered, so
    the check costs one dictionary lookup per step.
    """

    def __init__(self, owner: Any = None) -> None:
        """Watch for the optimizers of ``owner`` (an Accelerator): closed once ``owner`` is collected."""
        self._names: dict[int, str] = {}  # id of a replaced parameter that is alive -> its name
        self._refs: dict[int, weakref.ref] = {}
        self._clean: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        self._handle: Any = None
        if owner is not None:
            weakref.finalize(owner, self.close)

    def __reduce__(self) -> tuple[type, tuple]:
        # an Accelerator is pickled into the processes `acc.launch(fn)` spawns: parameters do not
        # cross processes, so the copy starts watching nothing
        return (OrphanWatch, ())

    @contextmanager
    def watch(self, module: nn.Module) -> Iterator[None]:
        """Around ``setup``: afterwards, watch ``module``'s former parameters that ``setup`` replaced."""
        before = {id(p): (name, p) for name, p in module.named_parameters(remove_duplicate=False)}
        yield
        self._track(before, module)
        before.clear()  # the watch holds the replaced parameters only weakly: drop them now

    def _track(self, before: dict[int, tuple[str, nn.Parameter]], module: nn.Module) -> None:
        current = {id(p) for p in module.parameters()}
        for key, (name, param) in before.items():
            if key not in current and key not in self._refs:
                self._refs[key] = weakref.ref(param, functools.partial(self._forget_ref, key))
                self._names[key] = name
        if self._refs:
            self._clean.clear()
            if self._handle is None:
                self._handle = register_global_step_pre_hook(self._check)

    @property
    def active(self) -> bool:
        """Whether the step pre-hook is registered (some replaced parameter is still alive)."""
        return self._handle is not None

    def close(self) -> None:
        """Stop watching and remove the hook."""
        self._refs.clear()
        self._names.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forget_ref(self, key: int, _ref: weakref.ref) -> None:
        self._forget(key)

    def _forget(self, key: int) -> None:
        self._refs.pop(key, None)
        self._names.pop(key, None)
        if not self._refs:
            self.close()

    def _check(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        params = optimizer_parameters(optimizer)
        if self._clean.get(optimizer) == len(params):
            return
        orphaned = [self._names[id(p)] for p in params if id(p) in self._names]
        if not orphaned:
            self._clean[optimizer] = len(params)
            return
        shown = ", ".join(orphaned[:4]) + (", ..." if len(orphaned) > 4 else "")
        raise RuntimeError(
            f"This {type(optimizer).__name__} holds {len(orphaned)} parameter(s) that `acc.setup` replaced"
            f" ({shown}): its step() would leave the model unchanged. Pass the optimizer to setup:"
            " `model, optimizer = acc.setup(model, optimizer)` (or `optimizer ="
            " acc.setup_optimizers(optimizer)` after `acc.setup_module(model)`), or build it after setup"
            " from the returned model's parameters."
        )
