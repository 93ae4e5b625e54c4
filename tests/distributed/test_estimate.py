"""The memory estimator against the measured peak RSS of real runs (fresh processes, tuned malloc).

The bound here is loose (+-30%): the machine is shared. benchmarks/bench_estimate.py measures
5 configurations of a bigger model; its table in benchmarks/README.md is within +-15%.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_estimate import estimate, measure

pytestmark = pytest.mark.distributed

# big enough that the run's fixed overhead (gloo, FSDP bookkeeping: ~25-45 MiB) is a small part
SMALL = {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 8, "n_embd": 512, "tied": False}
BATCH = (4, 128)


@pytest.mark.xfail(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15),
    reason="known open on torch 2.15: the FSDP estimate (torch's FSDPMemTracker on fake tensors) is"
    " below the measured peak by more than 30 % (298 MB estimated, 434 MB measured, 2 ranks)",
    strict=False,
)
def test_fsdp_estimate_is_close_to_measured_peak() -> None:
    real = measure(("fsdp", 2, False), SMALL, BATCH)
    est = estimate(("fsdp", 2, False), SMALL, BATCH)
    assert abs(est - real) <= 0.3 * real, (est, real)
