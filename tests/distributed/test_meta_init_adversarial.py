"""Unusual init code on 2 FSDP ranks: bitwise equal to eager construction on every rank.

The models of ``tests/unit/test_meta_init_adversarial.py`` (``Tensor.set_`` through
parametrizations, indexing writes, explicit generators, torch layers, RNG between layers) and two
``transformers`` families; each rank builds the eager reference itself from the same seed and
returns what differed, the random stream after construction included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.init_styles import mismatches
from tests.unit.test_meta_init_adversarial import CASES, _hf

pytestmark = pytest.mark.distributed


def _exact(acc: Accelerator, build) -> list[str]:
    torch.manual_seed(0)
    np.random.seed(0)
    eager = build()
    streams = (torch.rand(8), np.random.rand())
    torch.manual_seed(0)
    np.random.seed(0)
    with acc.init_module(empty_init=True):
        model = build()
    failures = [] if torch.equal(torch.rand(8), streams[0]) else ["torch random stream"]
    failures += [] if np.random.rand() == streams[1] else ["numpy random stream"]
    return failures + mismatches(eager, acc.setup(model))


def cases_on_ranks(rank: int, world_size: int) -> dict[str, list[str]]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    out = {name: _exact(acc, build) for name, build in CASES.items()}
    for family in ("llama", "t5"):
        out[family] = _exact(acc, lambda family=family: _hf(family))
    return out


def test_unusual_init_code_equals_eager_on_every_rank() -> None:
    pytest.importorskip("transformers")
    results = run_distributed(cases_on_ranks, 2, 2, timeout=300)
    assert len(results) == 2
    for result in results:
        assert result == {name: [] for name in result}, result


def self_check_on_rank_zero_only(rank: int, world_size: int) -> str | None:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    with acc.init_module(empty_init=True, verify=acc.global_rank == 0):
        model = torch.nn.Linear(4, 4)
    try:
        acc.setup(model)
    except ValueError as e:
        return str(e) if model.weight.is_meta else f"raised after materializing: {e}"
    return None


def test_the_self_check_asked_for_on_some_ranks_only_raises_on_every_rank() -> None:
    """Not a hang: rank 0 would wait in the check's broadcast while the others went on."""
    results = run_distributed(self_check_on_rank_zero_only, 2, 2, timeout=120)
    for message in results:
        assert message is not None and "on some ranks only" in message, results
