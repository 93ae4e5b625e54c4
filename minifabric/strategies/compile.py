"""``torch.compile`` under every strategy, without ``_orig_mod.`` in parameter names.

A strategy's ``compile`` option (``True`` or a dict of ``torch.compile`` keyword arguments) and a
model the user passed through ``torch.compile(model)`` end up the same way: the original module is
set up, and compile is applied *in place* (as ``module.compile()`` does) to what the strategy
runs: the whole model (single device), the DDP wrapper (so DDP's bucketing splits the graph), or
each FSDP unit before ``fully_shard`` (so FSDP's all-gather and reduce-scatter hooks still fire
around each compiled block). Parameter names, state dicts and checkpoints are those of the
uncompiled model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from minifabric._torch import compile_in_place, split_compiled

#: ``False`` (default), ``True`` (``torch.compile`` defaults) or ``torch.compile`` keyword arguments.
CompileOption = bool | dict[str, Any]
Compiler = Callable[[Callable], Callable]

__all__ = [
    "CompileOption",
    "Compiler",
    "check_compile_option",
    "compile_modules",
    "resolve_compiler",
    "split_compiled",
]


def check_compile_option(value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile keyword arguments, got {value!r},"
            ' e.g. `FSDPStrategy(compile=True)` or `FSDPStrategy(compile={"mode": "max-autotune"})`.'
        )
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(value) - accepted)
    if unknown:
        raise TypeError(
            f"compile={value!r} has keys torch.compile does not take: {', '.join(map(repr, unknown))}."
            f' Use some of {", ".join(sorted(accepted))}, e.g. `compile={{"fullgraph": True}}`.'
        )


def resolve_compiler(option: CompileOption, user_compiler: Compiler | None) -> Compiler | None:
    """The compile function to apply: the option's, else the one the user compiled the model with.

    A dict option names explicit ``torch.compile`` arguments and wins; ``True`` keeps the options of
    a user's ``torch.compile(model, ...)`` if there was one; ``False`` compiles only if the user did.
    """
    if isinstance(option, dict):
        return functools.partial(torch.compile, **option)
    if user_compiler is not None:
        return user_compiler
    return torch.compile if option else None


def compile_modules(modules: Iterable[nn.Module], compiler: Compiler) -> None:
    """Compile each module's call in place (names, class and hooks unchanged)."""
    for module in modules:
        compile_in_place(module, compiler)


def compile_children_in_place(module: nn.Module) -> None:
    """Replace every ``torch.compile(child)`` inside ``module`` by the child compiled in place.

    A function that sets ``model.blocks[i] = torch.compile(block)`` puts ``_orig_mod.`` into the
    parameter names (so optimizers and checkpoints no longer match the model); compiling the block
    in place with the same options runs the same code and keeps the names.

    Raises:
        TypeError: a compiled child was itself sharded with ``fully_shard`` (its hooks would sit
            on the wrapper, outside the compiled code); shard the block, then compile it in place.
    """
    from torch.distributed.fsdp import FSDPModule  # not at import: `import minifabric` stays light

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            original, compiler = split_compiled(child)
            if compiler is None:
                continue
            if isinstance(child, FSDPModule):
                raise TypeError(
                    f"{name!r} is `fully_shard(torch.compile(block))`: FSDP's hooks would run outside the"
                    " compiled code. Shard the block itself and compile it in place:"
                    " `fully_shard(block, mesh=...); block.compile()`."
                )
            setattr(parent, name, original)
            compile_in_place(original, compiler)
