"""Record what a model's ``__init__`` does to its meta tensors; replay it at full size later.

Inside ``init_module(empty_init=True)`` parameters live on the meta device, where ``normal_``,
``zero_``, ``copy_`` and every ``torch.nn.init`` function do nothing. :class:`InitRecorder` (a
``TorchFunctionMode``, active only inside that context) watches every torch call and keeps, for
each meta tensor it tracks (a :class:`Base`), the list of in-place operations applied to it, to
it through a view (``w.data[0].zero_()``), or to a tensor computed from it. Random operations are
also run once on a scratch tensor of the same shape, so the global random stream advances exactly
as in eager construction, and the generator state before each of them is kept.

:func:`~minifabric.strategies.init_replay.evaluate` replays a base's operations on a real CPU
tensor with the same generator states. Each base is replayed on its own, so a strategy can
materialize one parameter at a time (and keep only its shard).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from minifabric.strategies.init_replay import (
    SEQ,
    TARGET,
    Base,
    Handle,
    Op,
    Real,
    Ref,
    apply_chain,
    call,
    handle_of,
    identity,
    same_view,
    scratch_value,
    set_handle,
    storage_id,
)

#: In-place operations that never draw random numbers (no scratch run needed).
_DETERMINISTIC = {
    "zero_", "fill_", "copy_", "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_",
    "masked_fill_", "index_fill_", "index_copy_", "scatter_", "fill_diagonal_", "pow_", "sqrt_", "neg_",
    "abs_", "exp_", "log_", "erfinv_", "tanh_", "sign_", "floor_", "round_", "addcmul_", "addcdiv_", "lerp_",
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "constant_", "ones_", "zeros_",
    "eye_", "dirac_",
}  # fmt: skip
#: In-place methods that change a tensor's shape or storage: not replayable.
_UNSUPPORTED = {"resize_", "set_", "as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_"}
#: In-place methods that change only autograd metadata.
_METADATA = {"requires_grad_", "retain_grad", "share_memory_", "rename_"}
_EMPTY_FACTORIES = {"empty", "empty_like", "new_empty", "empty_strided"}
#: Out-of-place calls that draw random numbers (their result becomes a tracked tensor).
_DATA: Any = torch.Tensor.data  # the `.data` property: its __set__ replaces a tensor's data
_RANDOM_CREATIONS = {
    "randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like", "randint_like", "bernoulli",
    "multinomial", "poisson", "dropout", "rrelu",
}  # fmt: skip


def _name(func: Callable) -> str:
    owner: Any = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # property access: Tensor.data, Tensor.is_meta
        return f"{owner.__name__}.{func.__name__}"
    return getattr(func, "__name__", "")


def _is_inplace(name: str) -> bool:
    if name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
        return True
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


class InitRecorder(TorchFunctionMode):
    """Records in-place init of tracked meta tensors (see the module docstring).

    While it is active, ``torch.empty`` (and ``empty_like``, ``new_empty``, ``empty_strided``) of a
    CPU floating-point tensor returns a tracked meta tensor instead: that is how parameters are
    born without memory. Real tensors are left alone, so buffers computed in ``__init__`` are real.
    """

    def __init__(self) -> None:
        super().__init__()
        self._alive: list[torch.Tensor] = []  # tracked meta tensors: their storages are never reused
        self._by_storage: dict[int, tuple[torch.Tensor, Base]] = {}
        self.paused = 0

    @contextmanager
    def paused_recording(self) -> Iterator[None]:
        """Inside, torch calls pass through unrecorded."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # ---- tracking ------------------------------------------------------------------------------

    def track(self, t: torch.Tensor, base: Base) -> Handle:
        handle = Handle(base)
        set_handle(t, handle)
        self._alive.append(t)
        self._by_storage[storage_id(t)] = (t, base)
        return handle

    def lookup(self, t: Any) -> Handle | None:
        """The handle of ``t``: its own, or its base's when ``t`` covers the same storage the same way."""
        handle = handle_of(t)
        if handle is not None or not isinstance(t, torch.Tensor) or not t.is_meta:
            return handle
        found = self._by_storage.get(storage_id(t))
        if found is not None and same_view(found[0], t):
            handle = Handle(found[1])
            set_handle(t, handle)
            return handle
        return None

    # ---- the mode ------------------------------------------------------------------------------

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = _name(func)
        if name == "is_meta.__get__" and self.lookup(args[0]) is not None:
            self._record_nn_init_caller(args[0])
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tracked = [(t, h) for t in flat if (h := self.lookup(t)) is not None]
        if name in _EMPTY_FACTORIES and not tracked:
            return self._empty(func, args, kwargs)
        if not tracked:
            result = func(*args, **kwargs)
            if (
                isinstance(result, torch.Tensor)
                and result.is_meta
                and not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)
                and self.lookup(result) is None
            ):
                return self._fresh(func, args, kwargs, result)
            return result
        if name == "data.__set__":
            return self._set_data(args[0], args[1])
        out = kwargs.get("out")
        if _is_inplace(name) or (isinstance(out, torch.Tensor) and self.lookup(out) is not None):
            if name in _METADATA:
                return func(*args, **kwargs)
            target = out if isinstance(out, torch.Tensor) else args[0] if args else kwargs.get("tensor")
            return self._inplace(func, name, target, args, kwargs)
        return self._derived(func, args, kwargs, tracked)

    def _empty(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        if (
            not isinstance(result, torch.Tensor)
            or result.device.type not in ("cpu", "meta")
            or not result.is_floating_point()
        ):
            return result
        meta = torch.empty_strided(result.shape, result.stride(), dtype=result.dtype, device="meta")
        del result
        self.track(meta, Base(meta.shape, meta.dtype, "empty"))
        return meta

    def _ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        handle = self.lookup(value)
        if handle is not None:
            return Ref(handle, next(SEQ))
        if value.is_meta:
            raise _Unreplayable("reads a meta tensor created outside `init_module`")
        return Real(value, value._version)

    def _op(self, func: Callable, args: tuple, kwargs: dict, target: Any = None, **extra: Any) -> Op:
        def convert(v: Any) -> Any:
            return TARGET if target is not None and v is target else self._ref(v)

        return Op(func, tree_map(convert, args), tree_map(convert, kwargs), next(SEQ), **extra)

    def _inplace(self, func: Callable, name: str, target: Any, args: tuple, kwargs: dict) -> Any:
        handle = self.lookup(target)
        if handle is None:  # writes an untracked tensor using a tracked one's value
            return self._derived(func, args, kwargs, [])
        base = handle.base
        if name in _UNSUPPORTED:
            base.problem = base.problem or f"`{name}` changes the tensor's shape or storage"
            return func(*args, **kwargs)
        try:
            op = self._op(func, args, kwargs, target=target)
            op.target = handle
        except _Unreplayable as e:
            base.problem = base.problem or f"`{name}` {e}"
            return target
        if name not in _DETERMINISTIC:
            self._advance_rng(op)
        base.ops.append(op)
        if type(target) in (torch.Tensor, torch.nn.Parameter) and "out" not in kwargs:
            func(*args, **kwargs)  # on meta: fails on bad shapes as eager would
        return None if name == "__setitem__" else target

    def _advance_rng(self, op: Op) -> None:
        """Run ``op`` on scratch tensors so the random streams advance as in eager construction."""
        gens = {k: v for k, v in op.kwargs.items() if isinstance(v, torch.Generator)}
        op.generators = {k: g.get_state() for k, g in gens.items()}
        before = torch.get_rng_state()
        scratch = None
        if op.target is not None:
            base = op.target.base
            scratch = apply_chain(torch.empty(base.shape, dtype=base.dtype), op.target.chain, scratch_value)
        call(op, scratch, scratch_value, dict(gens))
        if not torch.equal(before, torch.get_rng_state()):
            op.rng = before
        if all(torch.equal(op.generators[k], g.get_state()) for k, g in gens.items()):
            op.generators = {}

    def _fresh(self, func: Callable, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
        """A meta tensor made from no tensor (``torch.zeros(n, device="meta")``): replayed on the CPU."""
        base = Base(result.shape, result.dtype, "computed")
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": "cpu"}
        base.creator = Op(func, args, kwargs, next(SEQ))
        self._advance_rng(base.creator)
        self.track(result, base)
        return result

    def _set_data(self, target: torch.Tensor, value: torch.Tensor) -> None:
        handle = self.lookup(target)
        source = self.lookup(value)
        if handle is None:
            return _DATA.__set__(target, value)
        _DATA.__set__(target, value if value.is_meta else value.to("meta"))
        if source is not None and source.base is handle.base and not source.chain:
            return None
        base = Base(value.shape, value.dtype, "computed")
        try:
            base.creator = self._op(identity, (value,), {})
        except _Unreplayable as e:
            base.problem = f"`.data =` {e}"
        self.track(target, base)
        return None

    def _derived(self, func: Callable, args: tuple, kwargs: dict, tracked: list) -> Any:
        result = func(*args, **kwargs)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for index, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor) or not out.is_meta or self.lookup(out) is not None:
                continue
            which = None if out is result else index
            source = next(((t, h) for t, h in tracked if storage_id(t) == storage_id(out)), None)
            if source is not None:  # a view: writes through it reach the base
                step = (func, *self._view_args(args, kwargs, source[0]), which)
                set_handle(out, Handle(source[1].base, (*source[1].chain, step)))
                continue
            base = Base(out.shape, out.dtype, "computed")
            try:
                base.creator = self._op(func, args, kwargs, index=which)
            except _Unreplayable as e:
                base.problem = f"`{_name(func)}` {e}"
            if base.creator is not None and _name(func) in _RANDOM_CREATIONS:
                self._advance_rng(base.creator)
            self.track(out, base)
        return result

    def _view_args(self, args: tuple, kwargs: dict, source: torch.Tensor) -> tuple[tuple, dict]:
        def convert(v: Any) -> Any:
            return TARGET if v is source else self._ref(v)

        return tree_map(convert, args), tree_map(convert, kwargs)

    def _record_nn_init_caller(self, tensor: torch.Tensor) -> None:
        """``torch.nn.init`` functions that return early on meta tensors: record the whole call.

        ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` check ``tensor.is_meta`` and do
        nothing; the outermost ``torch.nn.init`` frame on the stack holds the call's arguments.
        """
        frame: FrameType | None = sys._getframe(1)
        outer = None
        while frame is not None:
            if frame.f_globals.get("__name__") == "torch.nn.init":
                outer = frame
            elif outer is not None:
                break
            frame = frame.f_back
        if outer is None:
            return
        fn = getattr(torch.nn.init, outer.f_code.co_name, None)
        if fn is None or getattr(fn, "__code__", None) is not outer.f_code:
            return
        params = inspect.signature(fn).parameters
        kwargs = {n: outer.f_locals[n] for n in params if n in outer.f_locals}
        target = kwargs.pop("tensor", tensor)
        with self.paused_recording():
            self._inplace(fn, fn.__name__, target, (target,), kwargs)


class _Unreplayable(Exception):
    pass
