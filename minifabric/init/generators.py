"""The random streams an init draws from: the CPU's default generator and the build device's.

Eager construction inside ``init_module(empty_init=False)`` runs under the strategy's device, so on
CUDA a random init (``normal_``, ``torch.randn``) draws from that device's default generator and
leaves the CPU's alone. Meta init records on that same device (:class:`~minifabric.init.record.Recorder`
runs each random call once, for real, on a scratch tensor there), so it takes the same numbers from
the same stream, and keeps, per call, the states it started from: the CPU's (``Op.rng``) and the
device's (``Op.device_rng``), each only if the call advanced it. Replay at ``setup`` restores them
and runs the call on that device again. On the CPU the device is the CPU: one stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

CPU = torch.device("cpu")


def on_host(device: torch.device) -> bool:
    """Whether ``device`` draws from the CPU's generator (the CPU; the meta device draws nothing)."""
    return device.type in ("cpu", "meta")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (an accelerator's index left out: its current one)."""
    if a.type != b.type:
        return False
    return on_host(a) or _index(a) == _index(b)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.get_device_module(device.type).current_device()


def states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The states of the CPU's default generator and of ``device``'s (None on the CPU)."""
    device_state = None if on_host(device) else torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), device_state


def advanced(
    before: tuple[torch.Tensor, torch.Tensor | None], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Of the states ``before`` (from :func:`states`), those of the streams that moved since: else None."""
    after = states(device)
    return tuple(  # type: ignore[return-value]
        None if old is None or torch.equal(old, new) else old  # type: ignore[arg-type]
        for old, new in zip(before, after, strict=True)
    )


@contextmanager
def drawing_from(rng: torch.Tensor | None, device_rng: torch.Tensor | None, device: torch.device) -> Iterator[None]:
    """Inside, the CPU's default generator starts at ``rng`` and ``device``'s at ``device_rng`` (each
    if given); both are restored afterwards."""
    if rng is None and device_rng is None:
        yield
        return
    forked = [] if device_rng is None else [device]
    with torch.random.fork_rng(devices=forked, device_type=device.type if forked else "cuda"):
        if rng is not None:
            torch.set_rng_state(rng)
        if device_rng is not None:
            torch.get_device_module(device.type).set_rng_state(device_rng, device)
        yield


def generator(device: torch.device | str, state: torch.Tensor) -> torch.Generator:
    """A fresh generator on ``device`` in ``state`` (for an explicit ``generator=`` argument)."""
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def building_on(device: torch.device) -> Any:
    """The default-device context eager construction ran in on ``device`` (none on the CPU)."""
    return nullcontext() if on_host(device) else torch.device(device)
