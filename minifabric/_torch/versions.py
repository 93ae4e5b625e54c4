"""The torch versions minifabric supports: the range its test suite runs on, every one in CI.

pyproject.toml admits exactly this range. Differences between the versions inside it are handled
in this package by feature (``hasattr``, a probe at import), never by comparing version numbers.
"""

from __future__ import annotations

import torch

#: the oldest torch the test suite runs on
MIN_TORCH_VERSION = (2, 11)
#: the newest torch the test suite runs on (pyproject.toml admits torch>=2.11,<2.16)
MAX_TORCH_VERSION = (2, 15)


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` if the installed torch is older than the oldest minifabric is tested on.

    A newer torch than the tested range is let through: pip refuses to install one next to
    minifabric, and a torch built from source reports a development version.
    """
    if _parse(version) < MIN_TORCH_VERSION:
        low, high = _dotted(MIN_TORCH_VERSION), _dotted(MAX_TORCH_VERSION)
        raise ImportError(
            f"minifabric supports torch {low} to {high} (each tested in CI), found torch=={version}."
            f" Upgrade with: pip install 'torch>={low},<{MAX_TORCH_VERSION[0]}.{MAX_TORCH_VERSION[1] + 1}'"
        )
