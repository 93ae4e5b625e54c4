"""``acc.all_gather`` and ``acc.all_reduce`` with tensors that differ between ranks raise on every rank.

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
    "size": lambda rank: torch.ones(3) if rank == 0 else torch.ones(4),
    "same count, other shape": lambda rank: torch.ones(2, 3) if rank == 0 else torch.ones(3, 2),
}


def collect_mismatched(rank: int, world_size: int) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=world_size)
    acc.launch()
    out: dict = {"all_gather": {}, "all_reduce": {}}
    for op in out:
        for name, make in CASES.items():
            tensor = make(rank)
            try:
                getattr(acc, op)(tensor)
                out[op][name] = "no error"
            except ValueError as e:
                out[op][name] = str(e)
                assert torch.equal(tensor, make(rank)), "a refused all_reduce changed its tensor"
    out["after"] = acc.all_gather(torch.tensor([rank])).tolist()  # the ranks still pair their collectives
    out["sum"] = acc.all_reduce(torch.ones(2, 3), reduce_op="sum").tolist()
    return out


def test_collectives_with_other_shapes_or_dtypes_raise_on_every_rank() -> None:
    results = run_distributed(collect_mismatched, 2, 2, timeout=150)
    for out in results:
        for op in ("all_gather", "all_reduce"):
            errors = out[op]
            assert f"{op} needs the same shape" in errors["ndim"], out
            assert "(2,)" in errors["ndim"] and "(2, 2)" in errors["ndim"], out
            assert "same shape" in errors["scalar"] and "()" in errors["scalar"], out
            assert f"{op} needs the same dtype" in errors["dtype"] and "torch.float64" in errors["dtype"], out
            assert "same shape" in errors["size"] and "(4,)" in errors["size"], out
            assert "same shape" in errors["same count, other shape"] and "(3, 2)" in errors["same count, other shape"]
        assert out["after"] == [[0], [1]]
        assert out["sum"] == [[2.0] * 3] * 2
