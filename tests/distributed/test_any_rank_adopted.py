"""Agreements between ranks in a process group the Accelerator adopted (the script's own
``init_process_group``, Ray Train's, a second Accelerator's): each one communicates, so every rank
takes the same branch (before, a rank that had not created the group answered from its own flag)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from minifabric import Accelerator
from minifabric._torch import group_timeout
from tests.helpers import run_distributed


def _answers(rank: int) -> dict:
    dist.init_process_group("gloo")  # the script's own process group, before the Accelerator
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    flag_on_one = acc.strategy.any_rank(rank == 1)
    flag_on_none = acc.strategy.any_rank(False)
    with acc.rank_zero_first():  # its agreement on whether rank 0 failed communicates too
        pass
    acc.barrier()
    return {"one": flag_on_one, "none": flag_on_none}


def test_any_rank_in_an_adopted_process_group_is_the_same_answer_on_every_rank() -> None:
    assert run_distributed(_answers, 2, timeout=120) == [{"one": True, "none": False}] * 2


def _stop_group_timeout(rank: int) -> float:
    dist.init_process_group("gloo", timeout=timedelta(seconds=77))  # the script's own timeout
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    acc.strategy.any_rank(False)  # makes the small gloo group of the agreements
    seconds = group_timeout(acc.strategy.rank._stop_group).total_seconds()
    acc.barrier()
    return seconds


def test_the_agreement_group_of_an_adopted_process_group_keeps_its_timeout() -> None:
    """A dead peer fails the agreement after the script's timeout, not torch's 30 minute default."""
    assert run_distributed(_stop_group_timeout, 2, timeout=120) == [77.0, 77.0]

