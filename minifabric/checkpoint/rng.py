"""Each rank's random-number-generator states, recorded in every checkpoint.

Restoring them on load makes a resumed run draw the same dropout masks and random numbers as the
uninterrupted one, with no code in the user's loop. The record holds only tensors, lists and
numbers, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional for the RNG record
        return None
    return numpy


def capture() -> dict[str, Any]:
    """The python, numpy (if installed), torch and CUDA generator states of this process."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [
            name,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Set the generators from ``state``; return the names of those that could not be restored."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    skipped = []
    np = _numpy()
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    elif "numpy" in state:
        skipped.append("numpy (not installed)")
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            skipped.append("cuda (different device count)")
    return skipped
