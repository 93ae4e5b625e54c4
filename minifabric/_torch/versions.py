"""The torch versions minifabric supports."""

from __future__ import annotations

import torch

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
