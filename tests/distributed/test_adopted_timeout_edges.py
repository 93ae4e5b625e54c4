"""A timeout asked for (a strategy's ``timeout=``, ``MINIFABRIC_TIMEOUT``) where the process group already
exists: refused on every rank when the group holds another one (it would be ignored silently); the
group's own when it is the same value (process groups hold whole milliseconds, so a value with a
fraction of one is still the same)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from minifabric import Accelerator, DDPStrategy
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

SECONDS = 600 / 7  # 85.714285714...: a process group holds 85.714


def _same_timeout(rank: int, how: str) -> str:
    """The group is created with ``SECONDS`` (by the script, or by a first Accelerator given it); then
    an Accelerator asks for the same ``SECONDS`` (its strategy's ``timeout=``, or ``MINIFABRIC_TIMEOUT``)."""
    if how == "second-accelerator":
        Accelerator(accelerator="cpu", strategy=DDPStrategy(timeout=SECONDS), devices=2).launch()
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=SECONDS))
    if how == "env":
        os.environ["MINIFABRIC_TIMEOUT"] = repr(SECONDS)
    return _launch(DDPStrategy() if how == "env" else DDPStrategy(timeout=SECONDS))


def _launch(strategy: DDPStrategy) -> str:
    """``launch()`` an Accelerator with ``strategy`` in the existing group: "launched", or why it refused."""
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2)
    try:
        acc.launch()
        acc.barrier()
    except ValueError as e:
        return str(e)
    return "launched"


@pytest.mark.parametrize("how", ["strategy", "env", "second-accelerator"])
def test_the_same_timeout_with_a_fraction_of_a_millisecond_is_not_refused(how: str) -> None:
    """Before, the group's 85.714 s and the 85.714286 s asked for compared unequal: every rank raised."""
    assert run_distributed(_same_timeout, 2, how, timeout=120) == ["launched"] * 2


def _other_timeout(rank: int) -> str:
    dist.init_process_group("gloo", timeout=timedelta(seconds=SECONDS))
    return _launch(DDPStrategy(timeout=SECONDS + 0.001))


def test_a_timeout_one_millisecond_off_is_still_refused() -> None:
    refused = run_distributed(_other_timeout, 2, timeout=120)
    assert all("timeout=0:01:25.714000" in m and "init_process_group" in m for m in refused), refused


def _asked(rank: int, given: float | None, env: str | None) -> str:
    """The script's group, created with 77 s; then an Accelerator whose strategy is given ``given``
    (None: no ``timeout=``) with ``MINIFABRIC_TIMEOUT=env`` (None: unset)."""
    if env is not None:
        os.environ["MINIFABRIC_TIMEOUT"] = env
    dist.init_process_group("gloo", timeout=timedelta(seconds=77))
    return _launch(DDPStrategy() if given is None else DDPStrategy(timeout=given))


def test_a_timeout_given_to_the_strategy_that_an_adopted_process_group_does_not_have_is_refused_on_every_rank() -> None:
    """The group keeps the timeout it was created with: the one given would be ignored silently."""
    refused = run_distributed(_asked, 2, 30.0, None, timeout=120)
    assert all("timeout=0:00:30" in m and "timeout=0:01:17" in m and "init_process_group" in m for m in refused), refused
    assert run_distributed(_asked, 2, 77.0, None, timeout=120) == ["launched"] * 2  # the same: nothing ignored


def test_a_minifabric_timeout_an_adopted_process_group_does_not_have_is_refused_on_every_rank() -> None:
    refused = run_distributed(_asked, 2, None, "30", timeout=120)
    assert all("MINIFABRIC_TIMEOUT asks for timeout=0:00:30" in m and "unset MINIFABRIC_TIMEOUT" in m for m in refused)
    assert run_distributed(_asked, 2, None, "77", timeout=120) == ["launched"] * 2
