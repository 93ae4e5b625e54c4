"""The self-check: compare meta init with eager construction, tensor by tensor, and the random stream.

With ``init_module(empty_init=True, verify=True)`` (or ``MINIFABRIC_VERIFY_INIT=1``) the context
notes, for each model built in it, its class, the arguments its ``__init__`` was called with and
the random generators' states before and after. At ``setup``, :func:`self_check` (run on rank 0)
builds the model again eagerly on the build device (the strategy's) from those states and returns a
function that :func:`~minifabric.init.materialize.materialize` calls with each replayed full value:
the first value that differs from the eager one raises :class:`InitMismatch` naming the tensor. The
random streams after the eager build must equal those after the meta build.

It costs one eager model in rank 0's memory on the build device (the GPU's, under CUDA) and the time
to build it: use it once, when model code is new or changed, not in every run.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from minifabric._torch import module_construction_hook, tensor_version
from minifabric.init.generators import drawing_from, states

#: set to 1 to turn the self-check on for every ``init_module(empty_init=True)``
VERIFY_ENV = "MINIFABRIC_VERIFY_INIT"


# True while `self_check` builds a model again eagerly: a meta-init block its `__init__` enters
# (`with acc.init_module(empty_init=True):` around a part) builds eagerly too.
_REBUILDING: ContextVar[bool] = ContextVar("minifabric_init_rebuilding", default=False)


def rebuilding_eagerly() -> bool:
    """Whether :func:`self_check` is building a model again eagerly (meta-init blocks inside build eagerly)."""
    return _REBUILDING.get()


class InitMismatch(RuntimeError):
    """Meta-device init gave a value that eager construction with the same seed does not."""


@dataclass
class _Construction:
    cls: type
    args: tuple
    kwargs: dict
    device: torch.device  # the build device
    rng_before: tuple[torch.Tensor, torch.Tensor | None]  # the CPU's and the build device's (generators.states)
    rng_after: tuple[torch.Tensor, torch.Tensor | None] | None = None
    host_before: tuple = ()  # Python's and numpy's global random states before construction
    #: name -> (the real tensor there when construction ended, its version counter then)
    real: dict[str, tuple[weakref.ref, int]] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> None:
        # A copy of the model (`copy.deepcopy`, `AveragedModel`) was not built by this construction.
        return None


#: How a model built with the self-check on was built: a `_Construction` in the model's `__dict__`.
_BUILT_ATTR = "_minifabric_construction"


def _construction(module: nn.Module) -> _Construction | None:
    return module.__dict__.get(_BUILT_ATTR)


def verify_requested(verify: bool | None) -> bool:
    """``verify`` if given, else whether ``MINIFABRIC_VERIFY_INIT`` is set to 1."""
    if verify is None:
        value = os.environ.get(VERIFY_ENV, "0")
        if value not in ("0", "1", ""):
            raise ValueError(
                f"{VERIFY_ENV} must be 0 or 1, got {value!r}; e.g. `{VERIFY_ENV}=1 python train.py`."
            )
        return value == "1"
    return verify


@contextmanager
def noting_constructions(device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside, each outermost module construction is noted for :func:`self_check` (built on ``device``)."""
    device = torch.device(device)
    stack: list[nn.Module] = []

    def on_start(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not stack:
            module.__dict__[_BUILT_ATTR] = _Construction(
                type(module), args, kwargs, device, states(device), host_before=_host_rng_state()
            )
        stack.append(module)

    def on_end(module: nn.Module) -> None:
        stack.pop()
        built = _construction(module)
        if not stack and built is not None:
            built.rng_after = states(device)
            built.real = {
                name: (weakref.ref(t), tensor_version(t))
                for name, t in _named_tensors(module)
                if not t.is_meta
            }

    with module_construction_hook(on_start, on_end):
        yield


def _host_rng_state() -> tuple:
    numpy = sys.modules.get("numpy")  # imported by the model code if it draws from it
    return (random.getstate(), numpy.random.get_state() if numpy is not None else None)


@contextmanager
def _host_rng(state: tuple) -> Iterator[None]:
    """Inside, Python's and numpy's global random states are ``state``; afterwards, what they were.

    The eager rebuild draws from them as the first construction did (an init that uses
    ``np.random``), and the user's streams after ``setup`` are as without the self-check.
    """
    saved = _host_rng_state()

    def restore(to: tuple) -> None:
        if to:
            random.setstate(to[0])
            numpy = sys.modules.get("numpy")
            if numpy is not None and to[1] is not None:
                numpy.random.set_state(to[1])

    restore(state)
    try:
        yield
    finally:
        restore(saved)


def wants_check(module: nn.Module) -> bool:
    """Whether ``module`` was built with the self-check on (the same answer on every rank)."""
    return _construction(module) is not None


def self_check(
    module: nn.Module, build_context: Callable[[], ContextManager], root: nn.Module | None = None
) -> Callable[[str, torch.Tensor], None] | None:
    """Build ``module`` again eagerly; return the check :func:`materialize` calls with each full value.

    Also checks at once the random stream after construction and the tensors that are already real.

    Args:
        module: a model built inside ``init_module(empty_init=True, verify=True)``.
        build_context: the context the model was built in (the precision's default dtype).
        root: the model that is materialized, when it is not ``module`` but holds it (a
            ``parallelize_fn`` that returned a wrapper): the check is given names in ``root``.

    Raises:
        InitMismatch: the first difference, naming the tensor (or the random stream) and the fix.
    """
    built = module.__dict__.pop(_BUILT_ATTR, None)
    if built is None:
        warnings.warn(
            f"The meta-init self-check cannot rebuild this {type(module).__name__}: it was not constructed"
            " directly inside `init_module(empty_init=True, verify=True)` (a copy, or a module assembled from"
            " parts), so it is set up unchecked.",
            stacklevel=3,
        )
        return None
    prefix = "" if root is None or root is module else _prefix_in(root, module)
    if prefix is None:
        warnings.warn(
            f"The meta-init self-check cannot compare {type(root).__name__} with the eager build: it does not"
            f" hold the {type(module).__name__} that was built under `init_module(empty_init=True, verify=True)`"
            " (parallelize_fn returned another model), so it is set up unchecked.",
            stacklevel=3,
        )
        return None
    with (
        drawing_from(built.rng_before[0], built.rng_before[1], built.device),
        _host_rng(built.host_before),
        build_context(),
        torch.device(built.device),
    ):
        token = _REBUILDING.set(True)
        try:
            eager = built.cls(*built.args, **built.kwargs)
        finally:
            _REBUILDING.reset(token)
        after = states(built.device)
    if built.rng_after is not None and not all(
        (a is None) == (b is None) and (a is None or torch.equal(a, b))
        for a, b in zip(after, built.rng_after, strict=True)
    ):
        raise InitMismatch(
            f"The random stream after building {built.cls.__name__} under `init_module(empty_init=True)`"
            " is not where eager construction leaves it: a random call in its `__init__` was not recorded."
            " Build it with `acc.init_module(empty_init=False)` (and report the model code)."
        )
    expected = {name: t.detach() for name, t in _named_tensors(eager)}
    for name, t in _named_tensors(module):
        if _as_constructed(built, name, t):
            _compare(built.cls, name, t.detach().cpu(), expected)

    def check(name: str, full: torch.Tensor) -> None:
        _compare(built.cls, name.removeprefix(prefix), full, expected)

    return check


def _prefix_in(root: nn.Module, module: nn.Module) -> str | None:
    """``"name."`` of ``module`` inside ``root``, or None if ``root`` does not hold it."""
    return next((f"{name}." for name, sub in root.named_modules() if sub is module), None)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _as_constructed(built: _Construction, name: str, t: torch.Tensor) -> bool:
    """Whether ``t`` is the real tensor construction left at ``name``, unchanged since.

    Only that is construction's value: a part put in later (``load_state_dict(..., assign=True)``)
    or written in place after the block is kept by ``setup`` and not compared. Meta tensors are
    compared as their replayed values are computed; DTensors are skipped (set up already).
    """
    noted = built.real.get(name)
    if noted is None or t.is_meta or type(t) not in (torch.Tensor, nn.Parameter):
        return False
    ref, version = noted
    return ref() is t and tensor_version(t) == version


def _compare(cls: type, name: str, value: torch.Tensor, expected: dict[str, torch.Tensor]) -> None:
    want = expected.get(name)
    if want is None:
        raise InitMismatch(f"{cls.__name__}.{name} exists after meta init but not after eager construction.")
    value = value.to(want.device)
    if want.shape != value.shape or want.dtype != value.dtype or not torch.equal(want, value):
        if want.shape == value.shape and want.dtype == value.dtype:
            differ = (
                (want != value) & ~(want.isnan() & value.isnan())
                if want.is_floating_point()
                else want != value
            )
            detail = f"{int(differ.sum())} of {want.numel()} values differ"
        else:
            detail = (
                f"eager gives {tuple(want.shape)} {want.dtype}, meta init {tuple(value.shape)} {value.dtype}"
            )
        raise InitMismatch(
            f"Meta-device init of {cls.__name__}.{name} differs from eager construction with the same seed"
            f" ({detail}): its init is not recorded exactly. Build this model with"
            " `acc.init_module(empty_init=False)` (and report the model code)."
        )
