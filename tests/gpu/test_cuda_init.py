"""Meta-device init on one GPU against eager construction on the GPU (``init_module(empty_init=False)``)."""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CUDA_MARKS, mismatches
from tests.helpers import run_distributed
from tests.init_styles import NanoGPTStyle

pytestmark = CUDA_MARKS


def _meta_against_eager_on_device(rank: int, device: str, strategy: str) -> dict:
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1)
    acc.launch()
    torch.manual_seed(0)
    with acc.init_module(empty_init=False):
        eager = NanoGPTStyle()  # on the device, with the device's generator
    eager_devices = sorted({p.device.type for p in eager.parameters()})
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = NanoGPTStyle()
    model = acc.setup(model)
    return {"mismatches": mismatches(eager, model), "eager_devices": eager_devices}


@pytest.mark.xfail(
    strict=False, reason="meta init on CUDA replays the CPU generator today (device replay not built yet)"
)
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_meta_init_on_cuda_equals_eager_construction_on_cuda(strategy):
    (result,) = run_distributed(_meta_against_eager_on_device, 1, "cuda", strategy, timeout=240)
    assert result["eager_devices"] == ["cuda"]
    assert result["mismatches"] == []
