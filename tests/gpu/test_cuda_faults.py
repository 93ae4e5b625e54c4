"""On one GPU: an exception on the rank ends the run (with its traceback, non-zero exit, no process
left); a SIGTERM is read by ``should_stop`` at the next read."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CFG, CUDA_MARKS, batches
from tests.helpers import PYTHON, REPO, Session, free_port, run_distributed
from tests.models import GPT, gpt_loss

pytestmark = CUDA_MARKS

SCRIPT = str(REPO / "tests" / "gpu" / "raise_on_cuda.py")


@pytest.mark.parametrize("launcher", ["python", "minifabric-run"])
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_an_exception_on_a_cuda_rank_ends_the_run(launcher, strategy):
    args = ["cuda", strategy]
    if launcher == "python":
        cmd = [PYTHON, SCRIPT, *args]
    else:
        port = str(free_port())  # runs in parallel (pytest-xdist) must not share torchrun's default port
        cmd = [PYTHON, "-m", "minifabric", "run", "--accelerator", "cuda", "--devices", "1", "--main-port", port, SCRIPT, *args]
    run = Session(cmd)
    code, _ = run.finish(timeout=180)  # fails if a process of the run is left
    assert code != 0, run.output
    assert "STEP 1" in run.output and "STEP 2" not in run.output, run.output
    assert "RuntimeError: planned failure on cuda" in run.output, run.output


def _stopped_by_sigterm(rank: int, device: str, strategy: str) -> int | None:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1)
    acc.launch()
    model = GPT(CFG)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, batch in enumerate(batches(8).to(acc.device), start=1):
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # preemption
        if acc.should_stop:  # read once per step
            return step
    return None


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_should_stop_is_true_at_the_read_after_sigterm_on_cuda(strategy):
    assert run_distributed(_stopped_by_sigterm, 1, "cuda", strategy, timeout=240) == [3]
