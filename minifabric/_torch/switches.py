"""torch's process-wide switches that training sets: each one named helper that says why and undoes what it changed."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def register_global_step_pre_hook(hook: Callable[[Any, Any, Any], None]) -> Any:
    """Call ``hook(optimizer, args, kwargs)`` before every ``step()`` of every optimizer in the process.

    A process-wide switch: the caller owns the returned handle and must ``.remove()`` it as soon as
    it is not needed (see ``strategies/rebind.py``, which keeps it only while orphaned parameters live).
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(hook)


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


def forget_unscale(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
    """Forget that ``scaler`` unscaled ``optimizer``'s gradients in a step that was dropped.

    Why: ``GradScaler`` records per optimizer, in the private ``_per_optimizer_states``, that
    ``unscale_`` ran (a clip does it) and refuses a second ``unscale_`` until ``update()``. A step
    that a replica group drops calls neither ``step`` nor ``update`` (which would also move the
    scale), so without this the next step's clip would raise. The scale is left as it is.
    """
    scaler._per_optimizer_states.pop(id(optimizer), None)
