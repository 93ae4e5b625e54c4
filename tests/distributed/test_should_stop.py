"""The stop agreement: reading ``acc.should_stop`` is the collective; ``optimizer.step()`` stays local.

Every case runs on real gloo ranks. The collective timeout is short (``MINIFABRIC_TIMEOUT``), so a
hidden collective in a call users think is local shows as a failure in seconds, not a 30-minute
hang.
"""

import os
import signal
import time

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

SHORT_TIMEOUT = "20"  # seconds: a deadlock would end the rank well before the test's own limit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _rank_local_steps(rank: int, strategy: str) -> dict:
    os.environ["MINIFABRIC_TIMEOUT"] = SHORT_TIMEOUT
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices=2)
    acc.launch()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    head_optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)  # e.g. a probe's own schedule
    model, optimizer, head_optimizer = acc.setup(model, optimizer, head_optimizer)
    start = time.monotonic()
    steps = 0
    for step in range(6):
        acc.backward(model(torch.randn(4, 4)).sum())
        if rank == 0 or step % 2 == 0:  # a step skipped on a rank-local condition
            optimizer.step()
        optimizer.zero_grad()
        if rank == 0:  # an optimizer only rank 0 steps
            head_optimizer.step()
        steps += 1
    return {"steps": steps, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_optimizer_stepped_on_some_ranks_only_does_not_wait_for_the_others(strategy):
    results = run_distributed(_rank_local_steps, 2, strategy, timeout=120)
    for result in results:
        assert result["steps"] == 6, results
        assert result["seconds"] < float(SHORT_TIMEOUT), results  # no collective waited for a peer


def _eval_loop_stopped_by_sigterm(rank: int, strategy: str) -> dict:
    os.environ["MINIFABRIC_TIMEOUT"] = SHORT_TIMEOUT
    acc = Accelerator(accelerator="cpu", strategy=strategy, devices="auto" if strategy == "auto" else 2)
    acc.launch()
    model = acc.setup(_model())  # no optimizer: evaluation only
    model.eval()
    with torch.no_grad():
        for step in range(1, 200):
            model(torch.randn(4, 4))
            if rank == acc.world_size - 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # preemption of one rank
            if acc.should_stop:  # every rank reads it here, once per step
                return {"stopped_at": step, "world": acc.world_size}
            time.sleep(0.01)
    return {"stopped_at": None, "world": acc.world_size}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_one_rank_stops_an_eval_loop_on_every_rank_at_the_same_read(strategy):
    results = run_distributed(_eval_loop_stopped_by_sigterm, 2, strategy, timeout=120)
    assert [r["stopped_at"] for r in results] == [3, 3], results
    assert [r["world"] for r in results] == [2, 2]


def test_sigterm_stops_an_eval_loop_in_one_process_the_same_way():
    (result,) = run_distributed(_eval_loop_stopped_by_sigterm, 1, "auto", timeout=120)
    assert result == {"stopped_at": 3, "world": 1}


def _never_reads(rank: int) -> str:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    model = acc.setup(_model())
    model(torch.randn(4, 4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # nobody reads should_stop: the default action ends it
        time.sleep(30)
    return "done"


def test_sigterm_ends_a_rank_whose_loop_never_reads_should_stop():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died without a result \(exit codes \[-15\]\)"):
        run_distributed(_never_reads, 2, timeout=120)
