"""Every strategy on one GPU (world size 1) trains like a single device; checkpointing and compile under FSDP.

Runs compare with a tolerance (fp32): CUDA's attention backward and reductions use atomics, so two
equal runs need not be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from minifabric import Accelerator
from tests.gpu.common import CFG, CUDA_MARKS, batches, cpu_state, train
from tests.helpers import run_distributed
from tests.models import GPT, Block

pytestmark = CUDA_MARKS


def _identity_parallelize(model: torch.nn.Module, mesh) -> torch.nn.Module:
    return model  # no tensor parallelism: ModelParallelStrategy shards the rest with FSDP


def _strategy(name: str):
    from minifabric import FSDPStrategy, ModelParallelStrategy

    if name == "model_parallel":
        return ModelParallelStrategy(_identity_parallelize, data_parallel_size=1, tensor_parallel_size=1)
    if name == "fsdp_checkpointing":
        return FSDPStrategy(activation_checkpointing_policy={Block})
    if name == "fsdp_compile":
        return FSDPStrategy(compile=True)
    return name


def _train_with(rank: int, device: str, strategy: str) -> dict:
    acc = Accelerator(accelerator=device, strategy=_strategy(strategy), devices=1)
    acc.launch()
    torch.manual_seed(0)
    model = GPT(CFG)  # built on the CPU, the same weights for every strategy
    initial = cpu_state(model)
    # SGD: Adam turns rounding noise on parameters with ~0 gradient into full-size steps
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = train(acc, model, optimizer, batches())
    params = list(model.parameters())
    return {
        "initial": initial,
        "losses": losses,
        "final": cpu_state(model),
        "param_devices": sorted({getattr(p, "_local_tensor", p).device.type for p in params}),
        "sharded": all(hasattr(p, "full_tensor") for p in params),
    }


STRATEGIES = ["single", "ddp", "fsdp", "fsdp_cpu_offload", "model_parallel", "fsdp_checkpointing", "fsdp_compile"]


@pytest.fixture(scope="module")
def reference() -> dict:
    (result,) = run_distributed(_train_with, 1, "cuda", "single", timeout=240)
    return result


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_on_one_gpu_trains_like_a_single_device(strategy, reference):
    (result,) = run_distributed(_train_with, 1, "cuda", strategy, timeout=240)
    assert result["param_devices"] == (["cpu"] if strategy == "fsdp_cpu_offload" else ["cuda"])
    assert result["sharded"] == (strategy not in ("single", "ddp"))
    assert all(torch.equal(result["initial"][k], v) for k, v in reference["initial"].items())
    tolerance = 1e-3 if strategy == "fsdp_compile" else 1e-4  # inductor fuses and reorders
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=tolerance, atol=tolerance)
    for name, value in reference["final"].items():
        torch.testing.assert_close(result["final"][name], value, rtol=10 * tolerance, atol=10 * tolerance, msg=name)
