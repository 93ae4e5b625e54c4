"""The one place that knows about torch versions and torch's private modules, and torch's process-wide switches.

Everything version-specific or private lives here, so a torch upgrade touches one file. So does
every switch that changes torch for the whole process (the default dtype, the intra-op thread
count, the global optimizer hooks, ``nn.Module`` patches): each is one named helper that says why
and restores what it changed. The process-wide switches that are not torch's (exception hook,
signals, exit handlers) are in :mod:`minifabric.process`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "check_torch_version",
    "checkpoint_activations",
    "compile_in_place",
    "dcp_storage_info",
    "default_dtype",
    "default_store",
    "fake_tensor_mode",
    "fake_world",
    "fsdp_policy",
    "hold_state_changes",
    "intra_op_threads",
    "local_box",
    "local_slice",
    "memory_tracker",
    "module_construction_hook",
    "module_registration_hooks",
    "register_global_step_pre_hook",
    "return_freed_memory",
    "save_without_crc32",
    "seeded_op_probe",
    "split_compiled",
    "storage_key",
    "swap_module_tensors",
    "swapping_module_params",
    "tensor_version",
    "torch_init_call",
    "track_scheduler_steps",
    "tree_flatten",
    "tree_map",
    "unresolved_plan_keys",
]

#: the oldest torch the test suite runs on (pyproject.toml admits torch>=2.13,<2.14)
MIN_TORCH_VERSION = (2, 13)


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` if the installed torch is older than minifabric supports."""
    if _parse(version) < MIN_TORCH_VERSION:
        wanted = ".".join(map(str, MIN_TORCH_VERSION))
        raise ImportError(
            f"minifabric needs torch>={wanted} (the version its tests run on), found torch=={version}."
            f" Upgrade with: pip install 'torch>={wanted}'"
        )


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of storing them.

    Uses torch's composable ``checkpoint``, which works through forward hooks and so keeps the
    module's class and parameter names (optimizer rebinding and checkpoints match by name).
    """
    from torch.distributed._composable.checkpoint_activation import checkpoint

    checkpoint(module)


def register_global_step_pre_hook(hook: Callable[[Any, Any, Any], None]) -> Any:
    """Call ``hook(optimizer, args, kwargs)`` before every ``step()`` of every optimizer in the process.

    A process-wide switch: the caller owns the returned handle and must ``.remove()`` it as soon as
    it is not needed (see ``strategies/rebind.py``, which keeps it only while orphaned parameters live).
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(hook)


def split_compiled(module: nn.Module) -> tuple[nn.Module, Callable[[Callable], Callable] | None]:
    """``(original module, the compile function it was wrapped with)`` for a ``torch.compile(model)``.

    ``torch.compile(model)`` returns an ``OptimizedModule`` whose state dict keys carry an
    ``_orig_mod.`` prefix. Its ``dynamo_ctx`` compiles any callable with the user's options
    (backend, mode, fullgraph, ...), so the options survive re-applying compile elsewhere. For any
    other module: ``(module, None)``.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if (
        eval_frame is None
    ):  # torch.compile was never called: nothing is compiled (and dynamo costs ~1 s to import)
        return module, None
    compiler = None
    while isinstance(module, eval_frame.OptimizedModule):
        compiler = compiler or module.dynamo_ctx
        module = module._orig_mod
    return module, compiler


def compile_in_place(module: nn.Module, compiler: Callable[[Callable], Callable]) -> None:
    """Compile ``module``'s call in place, as ``module.compile(...)`` does, with any compile function.

    The module keeps its class, its hooks and its parameter names (no ``_orig_mod.`` in keys).
    """
    module._compiled_call_impl = compiler(module._call_impl)


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks in this one process (no communication).

    Collectives return at once with outputs of the right shape, so FSDP can be applied and run on
    fake tensors as rank 0 of ``world_size``. Process-wide: refused while a real group exists, and
    destroyed on exit.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "estimate_memory simulates the ranks with its own process group, but one is already"
            " initialized. Estimate before `acc.launch()`, or from the command line:"
            " `minifabric estimate pkg.module:make_model ...`."
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensor_mode(allow_real_inputs: bool = False) -> Any:
    """torch's ``FakeTensorMode``: tensors carry shape, dtype and device but no data.

    ``allow_real_inputs``: meta and real tensors made outside may enter (a model sharded on the
    meta device, the index tensors of a 2-D ``DeviceMesh``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_real_inputs)


def memory_tracker(module: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> Any:
    """torch's memory tracker over ``module`` and ``optimizer`` (``FSDPMemTracker`` for sharded ones).

    Used as a context manager around training steps; ``get_tracker_snapshot("peak")`` then gives, per
    device, the bytes of each kind of tensor at the peak.
    """
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(module, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    return tracker


@contextmanager
def module_registration_hooks(
    on_parameter: Callable[[nn.Module, str, nn.Parameter], nn.Parameter],
    on_buffer: Callable[[nn.Module, str, torch.Tensor], torch.Tensor],
) -> Iterator[None]:
    """Inside, ``nn.Module.register_parameter``/``register_buffer`` pass each tensor through a hook first.

    Each hook gets ``(module, name, tensor)`` and returns the tensor to register.

    A process-wide patch of ``nn.Module``, restored on exit (meta-device init uses it to see every
    parameter as it is registered).
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def patched_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, None if param is None else on_parameter(module, name, param))

    def patched_buffer(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(module, name, None if tensor is None else on_buffer(module, name, tensor), persistent)

    nn.Module.register_parameter = patched_parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = patched_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


def local_box(shape: Any, mesh: Any, placements: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's part of a tensor of ``shape`` under a DTensor layout: its shape and where it starts."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def local_slice(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's part of ``full`` under a DTensor layout, cut on ``full``'s own device (no comms)."""
    shape, offset = local_box(full.shape, mesh, placements)
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        full = full.narrow(dim, start, size)
    return full


def default_store() -> Any:
    """The key-value store of the default process group (shared by every rank of the run)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


#: glibc ``mallopt`` parameters and the threshold (bytes) minifabric sets on CPU runs
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_THRESHOLD = 128 * 1024
#: set to 0 to keep glibc's default malloc settings
TUNE_MALLOC_VAR = "MINIFABRIC_TUNE_MALLOC"


def return_freed_memory() -> bool:
    """Make glibc's malloc give freed blocks of 128 KiB and more back to the OS (CPU runs).

    FSDP frees its all-gathered parameters and gradient buffers every step; with glibc's default
    (adaptive) thresholds those blocks stay in the process, and a sharded rank's peak RSS ends
    above a replicated (DDP) one's. Large blocks are then mapped and unmapped instead, at some cost
    in step time. This lasts for the life of the process (glibc cannot restore its adaptive
    thresholds), so it is applied only to CPU training processes, never where the user chose:
    not when ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` are set, nor with
    ``MINIFABRIC_TUNE_MALLOC=0``. Returns whether it was applied.
    """
    if os.environ.get(TUNE_MALLOC_VAR, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if any(var in os.environ for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD)
    )


def hold_state_changes(ready: Any, modules: list[nn.Module]) -> list[Any]:
    """Make what changes training state in place wait until ``ready`` (a ``threading.Event``) is set.

    Every optimizer's ``step`` waits (a process-wide hook, so optimizers the caller never named are
    held too), and so does the forward of every submodule of ``modules`` that owns buffers (a
    BatchNorm updates its running statistics in forward). Returns the hook handles: removing them
    undoes the switch.
    """

    def hold(*_: Any) -> None:
        ready.wait()

    handles = [register_global_step_pre_hook(hold)]
    for module in modules:
        for sub in module.modules():
            if any(True for _ in sub.buffers(recurse=False)):
                handles.append(sub.register_forward_pre_hook(hold))
    return handles


# ---- meta-device init (minifabric/init/) ------------------------------------------------------------


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
    """Collects the ATen ops tagged ``nondeterministic_seeded`` (they draw from a generator) run inside it."""

    _mode_class: Any = None

    def __init__(self) -> None:
        self.seeded: list[str] = []
        self._mode = _probe_mode_class()(self.seeded)

    def __enter__(self) -> _SeededOpProbe:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _probe_mode_class() -> Any:
    if _SeededOpProbe._mode_class is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # No dynamo guard around __torch_dispatch__: it would import torch._dynamo (seconds)
                # at first use, and nothing is compiled inside the probe.
                return False

            def __init__(self, seen: list[str]) -> None:
                super().__init__()
                self.seen = seen

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if torch.Tag.nondeterministic_seeded in func.tags:
                    self.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        _SeededOpProbe._mode_class = Mode
    return _SeededOpProbe._mode_class


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


def fsdp_policy(module: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` was given for ``module`` (an ``FSDPModule``)."""
    return module._get_fsdp_state()._mp_policy  # type: ignore[operator]


#: how torch's ``parallelize_module`` says that a plan key matched no submodule (a warning, not an error)
_UNRESOLVED_PLAN_KEY = "Parallelize plan key"


@contextmanager
def unresolved_plan_keys() -> Iterator[list[str]]:
    """Collect the messages of torch's "plan key could not be resolved" warnings raised inside.

    torch's ``parallelize_module`` skips a plan entry that names no submodule with only a warning,
    so a typo leaves that layer replicated. The caller turns these messages into an error; every
    other warning is re-emitted unchanged.
    """
    import warnings

    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    for warning in caught:
        text = str(warning.message)
        if text.startswith(_UNRESOLVED_PLAN_KEY):
            found.append(text)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Inside, new floating-point tensors default to ``dtype``; the previous default is restored on exit.

    Why: ``init_module``/``init_tensor`` under a ``"*-true"`` precision create the model directly in
    its dtype (no float32 copy first). The default dtype is process-wide, so it is held only for
    the body of the context.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def intra_op_threads(count: int) -> Callable[[], None]:
    """Give this process ``count`` intra-op threads; return a function that restores the previous count.

    Why: every local rank is a full torch process with one thread per core by default, so ``N``
    ranks on one machine would run ``N`` times more threads than cores and slow each other down.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    return lambda: torch.set_num_threads(previous)


def track_scheduler_steps(scheduler: Any, optimizer: Any) -> Callable[[], None]:
    """Make ``scheduler`` drive ``optimizer`` and keep torch's "step order" check working on it.

    Why: torch's LR schedulers wrap ``optimizer.step`` when they are built, to warn if
    ``scheduler.step()`` runs before the first ``optimizer.step()``; they read the private flags
    ``_opt_called`` and ``_wrapped_by_lr_sched``. ``setup`` hands back a different optimizer object
    (the wrapper), so the same tracking is put on its ``step``, or every run would warn that
    ``optimizer.step()`` was overridden. Changes only ``optimizer`` (an instance attribute);
    returns a function that removes it.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step

    def undo() -> None:
        if optimizer.__dict__.get("step") is tracked_step:
            del optimizer.step

    return undo


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


def save_without_crc32(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` without the CRC32 of every record, for this call only.

    ``torch.serialization.set_crc32_options`` is process-wide: flipping it from a background save
    would drop the checksums of a user's own ``torch.save`` running meanwhile. This builds the
    archive writer with the option given per call instead (the CRC32 costs about a third of the
    write time of a shard; completeness is checked by the commit record's file sizes).
    """
    import pickle

    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

    writer = torch._C.PyTorchFileWriter(stream, False, _get_storage_alignment())
    try:
        _save(obj, writer, pickle, DEFAULT_PROTOCOL, False)
    finally:
        writer.write_end_of_file()
    stream.flush()


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one saved item lies in a ``.distcp`` file (``_StorageInfo``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
