"""The on-disk schema of a minifabric checkpoint, in one place.

Both formats store one dict ``{FORMAT_KEY: meta, "state": tree}``:

- a one-file checkpoint is that dict, written with ``torch.save`` (full tensors in the tree);
- a sharded checkpoint keeps it in the side record :data:`SIDE_RECORD` of its version folder, with
  each tensor of the tree replaced by a *tensor reference*
  ``{TENSOR_REF: key, "shape": [...], "dtype": "float32"}`` naming its DCP key.

``meta`` holds ``version`` (:data:`FORMAT_VERSION`), ``format`` (``"full"`` | ``"sharded"``),
``world_size``, ``kinds`` (what each entry of ``state`` is: :data:`KINDS`), ``tied`` (each
module's tied parameter names) and ``ranks`` (each rank's RNG and stateful states).

Everything is read with :func:`safe_load` (``torch.load(weights_only=True)``): reading a
checkpoint never runs code from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint.errors import CheckpointError

FORMAT_KEY = "__minifabric__"
#: The version this code writes; a checkpoint of a newer version is refused on open.
FORMAT_VERSION = 2
#: The side record of a sharded checkpoint's version folder.
SIDE_RECORD = "minifabric.pt"
#: What an entry of ``state`` is, as recorded in ``meta["kinds"]``.
KINDS = ("module", "optimizer", "stateful", "value")
TENSOR_REF = "__tensor__"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def kinds(state: dict[str, Any]) -> dict[str, str]:
    """What each entry is: ``"module"``, ``"optimizer"``, ``"stateful"`` or ``"value"``."""
    out = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = "module"
        elif isinstance(value, Optimizer):
            out[key] = "optimizer"
        else:
            out[key] = "stateful" if is_stateful(value) else "value"
    return out


def check_version(meta: dict[str, Any], where: Path) -> None:
    """Refuse a checkpoint written by a newer format than this code reads.

    Raises:
        CheckpointError: naming both versions and the fix.
    """
    version = meta.get("version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(where)!r} was written in checkpoint format version {version!r}; this minifabric reads"
            f" versions up to {FORMAT_VERSION}. Upgrade minifabric to load it."
        )


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a tensor reference of a sharded checkpoint's side record."""
    return isinstance(value, dict) and TENSOR_REF in value


def make_ref(key: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The reference stored in place of ``tensor`` (its global shape for a DTensor)."""
    return {TENSOR_REF: key, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def ref_dtype(ref: dict[str, Any]) -> torch.dtype:
    """The dtype a reference records."""
    dtype = getattr(torch, ref["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown dtype {ref['dtype']!r} in a checkpoint tensor reference.")
    return dtype


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The (global) shape of a tensor or tensor reference, else None."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if is_ref(value):
        return tuple(value["shape"])
    return None


def safe_load(source: Path | IO[bytes], where: str, *, mmap: bool = False, weights_only: bool = True) -> Any:
    """``torch.load`` of a checkpoint file (or stream) with ``weights_only=True``, on CPU.

    ``weights_only=False`` (only where a user asked for it) unpickles arbitrary classes.

    Raises:
        CheckpointError: the one message for every file that cannot be read safely: a pickle that
            names classes (loading it would run their code) says how to convert it; anything else
            says the file is no checkpoint that can be loaded safely.
    """
    try:
        return torch.load(source, map_location="cpu", weights_only=weights_only, mmap=mmap)  # type: ignore[arg-type]
    except Exception as err:
        unsupported = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
        if unsupported:
            raise CheckpointError(
                f"{where!r} needs unpickling of arbitrary classes ({unsupported[0]}), which loading never"
                " does. If you trust the file, pass `weights_only=False`, or convert those values once:"
                " `data = torch.load(path, weights_only=False)`, replace them by plain values (e.g."
                " `vars(args)`), `torch.save(data, path)`."
            ) from err
        raise CheckpointError(
            f"{where!r} is not a checkpoint that can be loaded safely ({type(err).__name__}: {err})."
        ) from err
