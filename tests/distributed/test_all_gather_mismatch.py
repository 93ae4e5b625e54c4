"""``acc.all_gather`` with tensors that differ between ranks in rank count or dtype raises on every rank.

Gloo aborts the process (or a 0-d tensor on one rank skips a collective the others enter, and the
ranks pair the wrong collectives) when the buffers of one all-gather differ in size, so the shapes
and dtypes are compared first, with collectives of one size on every rank.
"""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

CASES = {
    "ndim": lambda rank: torch.ones(2) if rank == 0 else torch.ones(2, 2),
    "scalar": lambda rank: torch.tensor(1.0) if rank == 0 else torch.ones(1),
    "dtype": lambda rank: torch.ones(3) if rank == 0 else torch.ones(3, dtype=torch.float64),
}


def gather_mismatched(rank: int, world_size: int) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=world_size)
    acc.launch()
    out = {}
    for name, make in CASES.items():
        try:
            acc.all_gather(make(rank))
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    out["after"] = acc.all_gather(torch.tensor([rank])).tolist()  # the ranks still pair their collectives
    return out


def test_all_gather_with_other_ranks_or_dtypes_raises_on_every_rank() -> None:
    results = run_distributed(gather_mismatched, 2, 2, timeout=150)
    for out in results:
        assert "same shape" in out["ndim"] and "(2,)" in out["ndim"] and "(2, 2)" in out["ndim"], out
        assert "same shape" in out["scalar"] and "()" in out["scalar"], out
        assert "dtype" in out["dtype"] and "torch.float64" in out["dtype"], out
        assert out["after"] == [[0], [1]]
