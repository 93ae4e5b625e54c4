"""What meta-device init (:mod:`minifabric.init`) needs from torch's internals and process-wide hooks."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from minifabric import process

#: The hooks of the `module_registration_hooks` blocks the running thread (context) is inside,
#: innermost last. Per context: blocks in two threads may end in any order, and a thread outside
#: every block registers tensors unhooked while another thread is inside one.
_REGISTRATION_HOOKS: ContextVar[tuple[tuple[Callable, Callable], ...]] = ContextVar(
    "minifabric_registration_hooks", default=()
)


@contextmanager
def module_registration_hooks(
    on_parameter: Callable[[nn.Module, str, nn.Parameter], nn.Parameter],
    on_buffer: Callable[[nn.Module, str, torch.Tensor], torch.Tensor],
) -> Iterator[None]:
    """Inside, ``nn.Module.register_parameter``/``register_buffer`` pass each tensor through a hook first.

    Each hook gets ``(module, name, tensor)`` and returns the tensor to register; in nested blocks
    the innermost hook runs first.

    A process-wide patch of ``nn.Module``, installed while any block is open and restored when the
    last one ends (:func:`minifabric.process.shared_patch`); it calls the hooks of the running
    thread's blocks only (meta-device init uses it to see every parameter as it is registered).
    """
    token = _REGISTRATION_HOOKS.set((*_REGISTRATION_HOOKS.get(), (on_parameter, on_buffer)))
    try:
        with process.shared_patch("nn.Module registration", _install_registration_patch):
            yield
    finally:
        _REGISTRATION_HOOKS.reset(token)


def _install_registration_patch() -> Callable[[], None]:
    """Patch ``nn.Module``'s registration methods to run this thread's hooks; return the undo."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def patched_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        for on_parameter, _ in reversed(_REGISTRATION_HOOKS.get()):
            if param is not None:
                param = on_parameter(module, name, param)
        register_parameter(module, name, param)

    def patched_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        for _, on_buffer in reversed(_REGISTRATION_HOOKS.get()):
            if tensor is not None:
                tensor = on_buffer(module, name, tensor)
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter = patched_parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = patched_buffer  # type: ignore[method-assign,assignment]

    def undo() -> None:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]

    return undo


def storage_key(t: torch.Tensor) -> int:
    """A key of the memory ``t`` views: equal for every view of one tensor (meta tensors included).

    Tensor subclasses without a storage get ``id(t)``.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def tensor_version(t: torch.Tensor) -> int:
    """The count of in-place writes to ``t`` and its views (torch's version counter; meta tensors too).

    Writes through ``t.data`` are not counted: ``.data`` is an alias with a counter of its own.
    """
    return t._version


@contextmanager
def swapping_module_params() -> Iterator[None]:
    """Inside, ``nn.Module._apply`` (``to_empty``, ``to``) keeps each ``Parameter`` object and swaps its contents.

    A process-wide switch of torch, restored on exit. FSDP2 needs it to re-point its sharded
    parameters at new storage, and keeping the objects keeps tied weights one parameter and an
    optimizer built before ``setup`` bound to the model.
    """
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def swap_module_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's and buffer's contents by ``fn(tensor)``, keeping the ``Parameter`` objects.

    ``nn.Module._apply`` under :func:`swapping_module_params`: what ``to_empty`` does, with any
    function (one that returns its argument leaves that tensor as it is). FSDP2 modules re-point
    their sharded parameters at the new storage.
    """
    with swapping_module_params():
        module._apply(fn)


class _SeededOpProbe:
    """Collects the ATen ops tagged ``nondeterministic_seeded`` (they draw from a generator) run inside it.

    ``seeded`` names them; ``calls`` holds every op run inside that draws or writes into a tensor
    (``(op, args, kwargs)``, in order): see :func:`minifabric._torch.philox.dense_fill`.
    """

    _mode_class: Any = None

    def __init__(self) -> None:
        self.seeded: list[str] = []
        self.calls: list[tuple[Any, tuple, dict]] = []
        self._mode = _probe_mode_class()(self.seeded, self.calls)

    def __enter__(self) -> _SeededOpProbe:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def written(self) -> list[torch.Tensor]:
        """The tensors the ops run inside wrote into."""
        return [t for call in self.calls for t in written_tensors(*call)]


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an ATen op called with ``args`` and ``kwargs`` writes into, read from its schema."""
    out = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        out += [t for t in (value if isinstance(value, list | tuple) else [value]) if isinstance(t, torch.Tensor)]
    return out


def _probe_mode_class() -> Any:
    if _SeededOpProbe._mode_class is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # No dynamo guard around __torch_dispatch__: it would import torch._dynamo (seconds)
                # at first use, and nothing is compiled inside the probe.
                return False

            def __init__(self, seen: list[str], calls: list) -> None:
                super().__init__()
                self.seen, self.calls = seen, calls

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                seeded = torch.Tag.nondeterministic_seeded in func.tags
                if seeded:
                    self.seen.append(str(func))
                if seeded or written_tensors(func, args, kwargs or {}):
                    self.calls.append((func, tuple(args), dict(kwargs or {})))
                return func(*args, **(kwargs or {}))

        _SeededOpProbe._mode_class = Mode
    return _SeededOpProbe._mode_class


@contextmanager
def refusing_writes(protected: dict[int, str], refuse: Callable[[str, str], BaseException]) -> Iterator[None]:
    """Inside, an ATen op that would write into protected memory raises ``refuse(name, op)`` before it runs.

    ``protected`` maps :func:`storage_key` of a tensor to its name. Which arguments an op writes is
    read from the op's schema (those marked as written: in-place ops, ``out=``), not from a list of
    names; writes through ``.data`` or any view reach the same storage and are caught too.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # as in the seeded-op probe: nothing is compiled inside

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            for tensor in written_tensors(func, args, kwargs):
                if storage_key(tensor) in protected:
                    raise refuse(protected[storage_key(tensor)], str(func))
            return func(*args, **kwargs)

    with Mode():
        yield


def seeded_op_probe() -> _SeededOpProbe:
    """A context manager whose ``.seeded`` lists the random ATen ops run inside it.

    Whether an op draws random numbers is decided by ATen's own op tag
    (``torch.Tag.nondeterministic_seeded``), not by a list of names, so new or rare random ops
    (``poisson``, ``binomial``, ``_standard_gamma``, ``alpha_dropout``) are seen too. It works on
    meta tensors: the op is seen before its (no-op) meta kernel runs.
    """
    return _SeededOpProbe()


_INIT_FILE = torch.nn.init.__file__


def torch_init_call(skip_files: tuple[str, ...] = ()) -> tuple[Callable, dict[str, Any]] | None:
    """The outermost ``torch.nn.init`` function running on the caller's stack, and its arguments.

    Walks up the Python stack from the caller (frames of ``skip_files`` and of ``torch.overrides``
    skipped) and takes the outermost of the consecutive frames whose code lives in
    ``torch/nn/init.py``. The function is rebuilt from that frame's code object, never looked up by
    name, so a wrapper or monkeypatch bound in its place (transformers wraps ``trunc_normal_`` and
    others while it initializes weights) cannot make minifabric record something else than what
    ran. The arguments are the frame's parameters as they are at the time of the call.
    Returns None when no such frame is on the stack.
    """
    frame: types.FrameType | None = sys._getframe(1)
    skip = (*skip_files, torch.overrides.__file__)
    while frame is not None and frame.f_code.co_filename in skip:
        frame = frame.f_back
    outer = None
    while frame is not None and frame.f_code.co_filename == _INIT_FILE:
        outer, frame = frame, frame.f_back
    if outer is None or outer.f_code.co_freevars:
        return None
    code = outer.f_code
    fn = types.FunctionType(code, outer.f_globals, code.co_name)
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return fn, {n: outer.f_locals[n] for n in names if n in outer.f_locals}


@contextmanager
def module_construction_hook(
    on_start: Callable[[nn.Module, tuple, dict], None], on_end: Callable[[nn.Module], None]
) -> Iterator[None]:
    """Inside, ``on_start(module, args, kwargs)`` runs when a module's outermost ``__init__`` starts
    (with the arguments it was called with) and ``on_end(module)`` when it returns.

    A process-wide switch for this thread (``sys.setprofile``), restored on exit; it slows Python
    calls down while active. The meta-init self-check uses it to rebuild a model eagerly with the
    arguments it was built with, and to read the random stream right after construction.
    """
    previous = sys.getprofile()
    active: dict[int, types.FrameType] = {}

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if code.co_name != "__init__" or event not in ("call", "return") or not code.co_argcount:
            return
        module = frame.f_locals.get(code.co_varnames[0])
        if not isinstance(module, nn.Module):
            return
        if event == "call" and id(module) not in active:
            active[id(module)] = frame
            args, kwargs = _call_arguments(frame)
            on_start(module, args, kwargs)
        elif event == "return" and active.get(id(module)) is frame:
            del active[id(module)]
            on_end(module)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _call_arguments(frame: types.FrameType) -> tuple[tuple, dict]:
    """The positional and keyword arguments a method frame was called with (``self`` left out)."""
    import inspect

    code, local = frame.f_code, frame.f_locals
    names = code.co_varnames
    positional = [local[n] for n in names[1 : code.co_argcount]]
    kwonly = names[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    kwargs = {n: local[n] for n in kwonly}
    at = code.co_argcount + code.co_kwonlyargcount
    if code.co_flags & inspect.CO_VARARGS:
        positional.extend(local[names[at]])
        at += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[at]])
    return tuple(positional), kwargs
