"""Recording what a model's ``__init__`` does to its meta tensors (a ``TorchFunctionMode``).

Inside ``init_module(empty_init=True)`` parameters live on the meta device, where ``normal_``,
``zero_``, ``copy_`` and every ``torch.nn.init`` function do nothing. :class:`Recorder` watches
every torch call and keeps, for each meta tensor it tracks (a :class:`~minifabric.init.recipe.Base`),
the in-place operations applied to it, to it through a view (``w.data[0].zero_()``), or to a
tensor computed from it.

How it decides, without lists of names:

- **Does a call draw random numbers?** The call is run on the meta tensors under a probe that sees
  the ATen ops it dispatches; an op tagged ``torch.Tag.nondeterministic_seeded`` draws from a
  generator. Such a call is also run once for real, on a scratch tensor of the same shape and
  strides (with the real values of the tensors it reads), so the random streams advance exactly as
  in eager construction; the generator states before it are kept for replay.
- **Which ``torch.nn.init`` function ran?** ``trunc_normal_``, ``orthogonal_``, ``sparse_`` and
  ``dirac_`` return early on meta tensors, after checking ``tensor.is_meta``; ``normal_``,
  ``uniform_`` and others hand the call to this mode with their *current binding* (which may be a
  wrapper: transformers wraps them while it initializes weights). In both cases the function is
  taken from the code object running on the stack (:func:`minifabric._torch.torch_init_call`), with
  the arguments it was called with.
- **Real tensors an init reads** are copied at the read: a later change to them (an array reused,
  a ``.data`` write, shared memory) does not reach the replayed weights.

What cannot be recorded exactly is marked on the base (``problem``) and raised at ``setup`` with
the parameter's name, or raised at once (a lazy parameter, an op whose result shape depends on
values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from minifabric import process
from minifabric._torch import seeded_op_probe, storage_key, torch_init_call, tree_flatten, tree_map
from minifabric.init.attach import Recording
from minifabric.init.calls import (
    DATA,
    DATA_SET,
    EMPTY_FACTORIES,
    IS_META,
    LIKE_FACTORIES,
    METADATA,
    RESHAPES,
    call_name,
    is_accessor,
    is_inplace,
    to_meta,
)
from minifabric.init.draws import Draws
from minifabric.init.generators import CPU, same_device
from minifabric.init.recipe import TARGET, Base, Handle, Op, Real, Ref, is_dtensor
from minifabric.init.replay import resolver
from minifabric.init.tracked import Tracked


class Unrecordable(ValueError):
    """A call inside ``init_module(empty_init=True)`` whose effect cannot be reproduced exactly."""


class Recorder(TorchFunctionMode):
    """Records the init of tracked meta tensors (see the module docstring).

    While it is active, ``torch.empty`` (and ``empty_like``, ``new_empty``, ``empty_strided``) of a
    floating-point tensor on ``device`` (the build device: where eager construction would put it)
    returns a tracked meta tensor instead: that is how parameters are born without memory. Real
    tensors are left alone, so buffers computed in ``__init__`` are real. Random calls run once for
    real on ``device``, drawing from its generator as eager construction does.
    """

    def __init__(
        self,
        keep: tuple[int, int] | None = None,
        device: torch.device | str = CPU,
        keep_on: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.draws = Draws(self.device, keep, self.device if keep_on is None else torch.device(keep_on))
        self.recording = Recording()  # what it records; held by the models built, not by the recorder
        self.tracked = Tracked(self.recording, self.device)
        self.paused = 0

    @contextmanager
    def paused_recording(self) -> Iterator[None]:
        """Inside, torch calls pass through unrecorded."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # ---- the mode ------------------------------------------------------------------------------

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if is_accessor(func, IS_META, "__get__"):
            if self.tracked.lookup(args[0]) is not None:
                self._record_torch_init(args[0])
            return func(*args, **kwargs)
        if func in EMPTY_FACTORIES:
            return self._empty(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tracked = [(t, h) for t in flat if (h := self.tracked.lookup(t)) is not None]
        if not tracked:
            result = func(*args, **kwargs)
            if (
                isinstance(result, torch.Tensor)
                and result.is_meta
                and not any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)
                and self.tracked.lookup(result) is None
            ):
                return self._fresh(func, args, kwargs, result)
            return result
        if is_accessor(func, DATA, "__set__"):
            return self._set_data(args[0], args[1])
        if func is torch.Tensor.numpy:
            return self._numpy(args[0], kwargs)
        if isinstance(func, FunctionType):
            found = torch_init_call(skip_files=(__file__,))
            if found is not None and found[0].__name__ == func.__name__:
                func, kwargs = found  # a torch.nn.init function, maybe called through a wrapper
                args = ()
        name = call_name(func)
        out = kwargs.get("out")
        if is_inplace(name) or (isinstance(out, torch.Tensor) and self.tracked.lookup(out) is not None):
            if func in METADATA:
                return func(*args, **kwargs)
            target = out if isinstance(out, torch.Tensor) else args[0] if args else kwargs.get("tensor")
            return self._inplace(func, name, target, args, kwargs)
        return self._derived(func, name, args, kwargs, tracked)

    def _empty(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if kwargs.get("out") is not None:  # writes a given tensor: creates none
            return func(*args, **kwargs)
        device = self._creates_on(func, args, kwargs)
        if device.type != "meta" and not same_device(device, self.device):
            return func(*args, **kwargs)  # elsewhere (a CPU tensor in a CUDA block): real, as in eager
        result = func(*(to_meta(args) if func is not torch.empty_strided else args), **{**kwargs, "device": "meta"})
        if not result.is_floating_point() and device.type != "meta":
            return func(*args, **{**kwargs, "device": device})  # an integer buffer (indices): real, as in eager
        meta = torch.empty_strided(result.shape, result.stride(), dtype=result.dtype, device="meta")
        del result
        self.tracked.track(meta, Base(meta.shape, meta.dtype, "empty", stride=meta.stride()))
        return meta

    def _creates_on(self, func: Callable, args: tuple, kwargs: dict) -> torch.device:
        """Where eager construction creates an empty factory's tensor: at its ``device=``, else where the
        input of ``empty_like``/``new_empty`` is (a tracked one: on its build device), else on the default
        device (the strategy's, whose context is active outside this mode)."""
        if kwargs.get("device") is not None:
            return torch.device(kwargs["device"])
        if func in LIKE_FACTORIES:
            source = args[0] if args else kwargs["input"]
            handle = self.tracked.lookup(source)
            return handle.base.device if handle is not None else source.device
        return torch.get_default_device()

    def _ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        handle = self.tracked.lookup(value)
        if handle is not None:
            return Ref(handle, process.next_number())
        if value.is_meta:
            raise Unrecordable("reads a meta tensor created outside `init_module`")
        return Real(value.detach().clone())  # by value: later changes to it must not reach replay

    def _op(
        self, func: Callable, name: str, args: tuple, kwargs: dict, target: Any = None, **extra: Any
    ) -> Op:
        def convert(v: Any) -> Any:
            return TARGET if target is not None and v is target else self._ref(v)

        return Op(func, tree_map(convert, args), tree_map(convert, kwargs), process.next_number(), name, **extra)

    def _inplace(
        self, func: Callable, name: str, target: Any, args: tuple, kwargs: dict, on_meta: bool = True
    ) -> Any:
        handle = self.tracked.lookup(target)
        if handle is None:  # writes a real tensor using a tracked one's value: run it for real
            return self._on_values(func, args, kwargs)
        base = handle.base
        if func in RESHAPES:
            base.problem = base.problem or f"`{name}` changes the tensor's shape or storage"
            return func(*args, **kwargs)
        try:
            op = self._op(func, name, args, kwargs, target=target)
        except Unrecordable as e:
            base.problem = base.problem or f"`{name}` {e}"
            return target
        op.target = handle
        base.problem = base.problem or _read_problem(op)
        seeded, calls = True, []  # unless the probe can tell: a scratch run is exact either way, only slower
        if on_meta and type(target) in (torch.Tensor, nn.Parameter):
            try:
                with seeded_op_probe() as probe:
                    func(*to_meta(args), **to_meta(kwargs))
                seeded, calls = bool(probe.seeded), probe.calls
            except (NotImplementedError, RuntimeError):
                if torch.is_grad_enabled() and target.requires_grad and target.is_leaf:
                    raise  # as in eager construction: an in-place op on a leaf that requires grad
                # else no meta kernel, or meta cannot take it (`out=` under a device context)
        base.kept = None  # a value kept from an earlier op is stale now
        if seeded:
            self.draws.advance(op, calls, target)
        if op.draws and is_dtensor(target):  # sharded in the block (`wrap`): DTensor's random rules, per part
            base.problem = base.problem or (
                f"`{name}` draws random numbers into it after `wrap` sharded it (eager construction draws"
                " each rank's part of the DTensor by DTensor's own random rules, which `setup` does not"
                " reproduce); initialize it before `wrap(...)`"
            )
        base.ops.append(op)
        return None if name == "__setitem__" else target

    def _fresh(self, func: Callable, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
        """A meta tensor made from no tensor (``torch.zeros(n, device="meta")``): replayed on the build device."""
        base = Base(result.shape, result.dtype, "computed")
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": self.device}
        base.creator = Op(func, args, kwargs, process.next_number(), call_name(func))
        self.draws.advance(base.creator)
        self.tracked.track(result, base)
        return result

    def _set_data(self, target: torch.Tensor, value: torch.Tensor) -> None:
        handle = self.tracked.lookup(target)
        source = self.tracked.lookup(value)
        if handle is None:
            return DATA_SET(target, value)
        DATA_SET(target, value if value.is_meta else value.to("meta"))
        if source is not None and source.base is handle.base and not source.chain:
            self.tracked.relaid(target)
            return None
        base = Base(value.shape, value.dtype, "computed")
        try:
            base.creator = self._op(_identity, "`.data =`", (value,), {})
            base.problem = _read_problem(base.creator)
        except Unrecordable as e:
            base.problem = f"`.data =` {e}"
        # eager construction leaves the tensor where the data put in is
        self.tracked.track(target, base, source.base.device if source is not None else value.device)
        return None

    def _numpy(self, t: torch.Tensor, kwargs: dict) -> Any:
        """``w.detach().numpy()`` of a tracked tensor: its value so far, as an array that refuses writes.

        In eager construction the array shares the tensor's memory; a write through it would change
        the tensor unseen, so the array is read-only (numpy raises at the write).
        """
        array = resolver()(self._ref(t)).numpy(**{k: v for k, v in kwargs.items() if k != "force"})
        array.flags.writeable = False
        return array

    def _derived(self, func: Callable, name: str, args: tuple, kwargs: dict, tracked: list) -> Any:
        on_meta = to_meta((args, kwargs))
        try:
            with seeded_op_probe() as probe:
                result = func(*on_meta[0], **on_meta[1])
        except (NotImplementedError, RuntimeError):
            # No meta kernel (_sample_dirichlet), a shape or a Python value that depends on the
            # values (a boolean mask, `if w.sum() > 0`): run it once on the real values.
            return self._run_for_real(func, name, args, kwargs)
        written = {storage_key(t) for t in probe.written()}
        for key in written:  # a write that is not an in-place method: `torch._foreach_mul_`
            for _, handle in self.tracked.by_storage.get(key, ()):
                handle.base.problem = handle.base.problem or f"`{name}` writes into it unrecorded"
        if written and written & _stand_ins((args, kwargs), on_meta):  # into a real tensor (`out=`): as in eager
            return self._on_values(func, args, kwargs)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for index, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor) or not out.is_meta or self.tracked.lookup(out) is not None:
                continue
            which = None if out is result else index
            source = next(((t, h) for t, h in tracked if storage_key(t) == storage_key(out)), None)
            if source is not None:  # a view: writes through it reach the base
                step = (func, *self._view_args(args, kwargs, source[0]), which)
                self.tracked.track(out, Handle(source[1].base, (*source[1].chain, step)))
                continue
            base = Base(out.shape, out.dtype, "computed")
            try:
                base.creator = self._op(func, name, args, kwargs, index=which)
                base.problem = _read_problem(base.creator)
            except Unrecordable as e:
                base.problem = f"`{name}` {e}"
            if base.creator is not None and probe.seeded:
                self.draws.advance(base.creator)
            self.tracked.track(out, base)
        return result

    def _on_values(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a call that writes a real tensor, with the values of the tracked tensors it reads."""
        resolve = resolver()
        real = tree_map(lambda v: resolve(self._ref(v)) if self.tracked.lookup(v) is not None else v, (args, kwargs))
        return func(*real[0], **real[1])

    def _run_for_real(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        """Run a call with no meta kernel on the real values of what it reads; track meta stand-ins.

        The run draws from the random streams exactly as eager construction does, so the states
        before it are what replay needs.
        """
        op = self._op(func, name, args, kwargs)
        result = self.draws.run(op)
        many = isinstance(result, (tuple, list))
        outputs = []
        for index, out in enumerate(result if many else (result,)):
            if not isinstance(out, torch.Tensor):
                outputs.append(out)
                continue
            meta = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
            base = Base(out.shape, out.dtype, "computed")
            base.creator = Op(op.func, op.args, op.kwargs, op.seq, name, None, index if many else None)
            base.creator.rng, base.creator.device_rng = op.rng, op.device_rng
            base.problem = _read_problem(op)
            base.creator.generators, base.creator.generator_devices = op.generators, op.generator_devices
            # where eager construction has it (``w.cpu()`` in a GPU block: the CPU), unless the call drew
            # from the build device's generator (then replay needs that device to restore it)
            self.tracked.track(meta, base, device=out.device if op.device_rng is None else None)
            outputs.append(meta)
        return type(result)(outputs) if many else outputs[0]

    def _view_args(self, args: tuple, kwargs: dict, source: torch.Tensor) -> tuple[tuple, dict]:
        def convert(v: Any) -> Any:
            return TARGET if v is source else self._ref(v)

        return tree_map(convert, args), tree_map(convert, kwargs)

    def _record_torch_init(self, tensor: torch.Tensor) -> None:
        """A ``torch.nn.init`` function that returns early on meta tensors: record the whole call.

        ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` check ``tensor.is_meta`` and do
        nothing; the outermost ``torch.nn.init`` frame on the stack is the call (see the module
        docstring). Whether it draws random numbers is seen when it runs on the scratch tensor.
        """
        found = torch_init_call(skip_files=(__file__,))
        if found is None:
            return
        fn, kwargs = found
        target = kwargs.get("tensor", tensor)
        with self.paused_recording():
            self._inplace(fn, fn.__name__, target, (), kwargs, on_meta=False)

    def check_parameter(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        """Refuse a parameter whose shape is unknown at construction (``nn.LazyLinear`` and friends)."""
        if nn.parameter.is_lazy(param):
            raise Unrecordable(
                f"{type(module).__name__}.{name} is a lazy parameter (`{type(module).__name__}` infers its"
                " shape at the first forward), so `init_module(empty_init=True)` cannot create or record it."
                f" Give the size up front (e.g. `nn.Linear(in_features, out_features)` instead of"
                " `nn.LazyLinear(out_features)`), or build this model with"
                " `acc.init_module(empty_init=False)` and run one forward before `setup`."
            )


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _read_problem(op: Op) -> str | None:
    """Why the value of a tensor ``op`` reads cannot be reproduced (then neither can what it writes)."""
    flat, _ = tree_flatten((op.args, op.kwargs))
    problem = next((r.handle.base.problem for r in flat if isinstance(r, Ref) and r.handle.base.problem), None)
    return None if problem is None else f"`{op.name}` reads a tensor whose value cannot be reproduced: {problem}"


def _stand_ins(tree: Any, on_meta: Any) -> set[int]:
    """The storage keys of the meta copies ``to_meta`` made of ``tree``'s real tensors."""
    return {
        storage_key(m)
        for t, m in zip(tree_flatten(tree)[0], tree_flatten(on_meta)[0], strict=True)
        if isinstance(t, torch.Tensor) and not t.is_meta
    }
