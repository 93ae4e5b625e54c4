"""The one place that knows about torch versions and torch's private modules.

Everything version-specific or private lives here, so a torch upgrade touches one file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = [
    "check_torch_version",
    "checkpoint_activations",
    "compile_in_place",
    "register_global_step_pre_hook",
    "split_compiled",
    "tree_map",
]

MIN_TORCH_VERSION = (2, 6)


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` if the installed torch is older than minifabric supports."""
    if _parse(version) < MIN_TORCH_VERSION:
        wanted = ".".join(map(str, MIN_TORCH_VERSION))
        raise ImportError(
            f"minifabric needs torch>={wanted} (FSDP2 and DTensor), found torch=={version}."
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
    from torch._dynamo.eval_frame import OptimizedModule

    compiler = None
    while isinstance(module, OptimizedModule):
        compiler = compiler or module.dynamo_ctx
        module = module._orig_mod
    return module, compiler


def compile_in_place(module: nn.Module, compiler: Callable[[Callable], Callable]) -> None:
    """Compile ``module``'s call in place, as ``module.compile(...)`` does, with any compile function.

    The module keeps its class, its hooks and its parameter names (no ``_orig_mod.`` in keys).
    """
    module._compiled_call_impl = compiler(module._call_impl)
