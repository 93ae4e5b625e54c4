"""Meta-device init off the common path on 2 FSDP ranks: bitwise equal to eager construction.

Every rank builds the eager reference itself (same seed) and compares the gathered full tensors of
the model it set up from ``init_module(empty_init=True)``, and the random stream after
construction; each rank returns what differed.
"""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator
from tests import hf_tiny, meta_cases
from tests.helpers import run_distributed
from tests.init_styles import STYLES, mismatches

pytestmark = pytest.mark.distributed


def _exact(acc: Accelerator, build) -> list[str]:
    torch.manual_seed(0)
    eager = build()
    stream = torch.rand(8)
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = build()
    failures = [] if torch.equal(torch.rand(8), stream) else ["random stream"]
    return failures + mismatches(eager, acc.setup(model))


def cases_on_ranks(rank: int, world_size: int) -> dict[str, list[str]]:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=world_size)
    acc.launch()
    out = {name: _exact(acc, meta_cases.CASES[name]) for name in ("rare_random", "spectral", "wrapped_init")}
    for family in hf_tiny.FAMILIES:
        out[family] = _exact(acc, lambda family=family: hf_tiny.build(family))
    # a pretrained backbone loaded with assign=True into a meta-built model is kept
    torch.manual_seed(5)
    pretrained = STYLES["nanogpt"]()
    torch.manual_seed(6)
    eager = STYLES["nanogpt"]()
    torch.manual_seed(6)
    with acc.init_module(empty_init=True):
        model = STYLES["nanogpt"]()
    backbone = {k: v for k, v in pretrained.state_dict().items() if k.startswith("blocks.")}
    model.load_state_dict(backbone, strict=False, assign=True)
    model = acc.setup(model)
    differ = mismatches(eager, model)
    out["assign"] = [n for n in differ if not n.startswith("blocks.")] + mismatches(
        pretrained.blocks, model.module.blocks if hasattr(model, "module") else model.blocks
    )
    if not differ:
        out["assign"].append("the pretrained backbone was not kept")
    out["verify"] = _self_check(acc)
    return out


class _Unseen(torch.nn.Module):
    """An init the recording cannot see: a helper that skips meta tensors, as some libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        if not self.b.weight.is_meta:
            torch.nn.init.constant_(self.b.weight, 0.5)


def _self_check(acc: Accelerator) -> list[str]:
    """``verify=True`` on 2 ranks: rank 0 compares with an eager build, and every rank gets its verdict."""
    with acc.init_module(empty_init=True, verify=True):
        exact = STYLES["hf"]()
    acc.setup(exact)  # equal to eager: no error on any rank
    with acc.init_module(empty_init=True, verify=True):
        unseen = _Unseen()
    try:
        acc.setup(unseen)
    except RuntimeError as error:
        return [] if "_Unseen.b.weight differs from eager" in str(error) else [str(error)]
    return ["the init the recording cannot see was not found"]


def test_off_path_init_and_transformers_models_equal_eager_on_every_rank() -> None:
    pytest.importorskip("transformers")
    results = run_distributed(cases_on_ranks, 2, 2, timeout=300)
    for result in results:
        assert result == {name: [] for name in result}, result
