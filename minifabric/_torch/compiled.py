"""Seeing through ``torch.compile`` wrappers, and compiling a module's call in place."""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn


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
