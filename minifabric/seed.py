"""Seeding every random number generator a training loop draws from, without importing lightning."""

from __future__ import annotations

import importlib.util
import os
import random

import torch

from minifabric import process

_MAX_SEED = 2**32 - 1  # numpy accepts uint32 seeds


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed Python's ``random``, numpy (if installed) and torch (every device) with ``seed``.

    Sets ``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS`` as Lightning's ``seed_everything`` does, so
    lightning's data-loading helpers see the same seed. With ``seed=None`` it reads
    ``PL_GLOBAL_SEED`` (default 0). Returns the seed used.

    Example:
        >>> from minifabric.seed import seed_everything
        >>> seed_everything(42)
        42
    """
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    if seed is None:
        env_seed = os.environ.get("PL_GLOBAL_SEED", "0")
        try:
            seed = int(env_seed)
        except ValueError:
            raise ValueError(f"PL_GLOBAL_SEED={env_seed!r} is not an int; set it to e.g. 42.") from None
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed!r} is out of range: pass an int from 0 to {_MAX_SEED}.")
    random.seed(seed)
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        np.random.seed(seed)
    torch.manual_seed(seed)
    process.export_seed(seed, workers)
    return seed
