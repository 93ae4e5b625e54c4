"""How the meta-init recorder tells torch calls apart: factories, in-place writes, reshapes, accessors.

Tables and predicates only (no state); :mod:`minifabric.init.record` acts on what they say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minifabric._torch import tree_map

#: Calls that create uninitialized memory: their result has no value until something writes it.
EMPTY_FACTORIES = frozenset({torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided})
#: Those of them that create their tensor where their input is (unless given ``device=``).
LIKE_FACTORIES = frozenset({torch.empty_like, torch.Tensor.new_empty})
#: In-place methods that change a tensor's shape or storage: not replayable.
RESHAPES = frozenset({
    torch.Tensor.resize_, torch.Tensor.set_, torch.Tensor.as_strided_, torch.Tensor.t_,
    torch.Tensor.transpose_, torch.Tensor.squeeze_, torch.Tensor.unsqueeze_, torch.Tensor.swapdims_,
})  # fmt: skip
#: In-place methods that change only autograd or naming metadata.
METADATA = frozenset({
    torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.share_memory_,
})  # fmt: skip
DATA: Any = torch.Tensor.data  # the `.data` property: its __set__ replaces a tensor's data
IS_META: Any = torch.Tensor.is_meta


def is_accessor(func: Callable, prop: Any, accessor: str) -> bool:
    """Whether ``func`` is ``prop.__get__``/``__set__`` (a new method-wrapper object at each access)."""
    return getattr(func, "__self__", None) is prop and getattr(func, "__name__", None) == accessor


def DATA_SET(target: torch.Tensor, value: torch.Tensor) -> None:
    DATA.__set__(target, value)


INPLACE_DUNDERS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")


def call_name(func: Callable) -> str:
    owner: Any = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # property access: Tensor.data, Tensor.is_meta
        return f"{owner.__name__}.{func.__name__}"
    return getattr(func, "__name__", repr(func))


def is_inplace(name: str) -> bool:
    if name in INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def to_meta(tree: Any) -> Any:
    """Real tensors replaced by meta ones of the same shape: for running a call on meta inputs."""
    return tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) and not v.is_meta else v, tree)
