"""DDPStrategy options on 2 gloo processes: DDP arguments, communication hooks, ZeRO-1.

One distributed run tries every option (process start-up dominates on 2 cores); each test then
checks one option on every rank.
"""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

from minifabric import Accelerator, DDPStrategy
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _strategy(name: str) -> DDPStrategy:
    return {
        "plain": lambda: DDPStrategy(),
        "unused_without_flag": lambda: DDPStrategy(),
        "static_graph": lambda: DDPStrategy(static_graph=True),
        "gradient_as_bucket_view": lambda: DDPStrategy(gradient_as_bucket_view=True),
        "find_unused_parameters": lambda: DDPStrategy(find_unused_parameters=True),
        "fp16_hook": lambda: DDPStrategy(comm_hook=default_hooks.fp16_compress_hook),
        "fp16_wrapper": lambda: DDPStrategy(
            comm_hook=default_hooks.allreduce_hook, comm_wrapper=default_hooks.fp16_compress_wrapper
        ),
        "bf16_hook": lambda: DDPStrategy(comm_hook=default_hooks.bf16_compress_hook),
        "powersgd": lambda: DDPStrategy(
            comm_hook=powerSGD_hook.powerSGD_hook,
            comm_state=powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
        ),
        "post_local_sgd": lambda: DDPStrategy(
            comm_hook=post_localSGD_hook.post_localSGD_hook,
            comm_state=post_localSGD_hook.PostLocalSGDState(None, None, start_localSGD_iter=2),
            model_averaging_period=2,
        ),
        "zero_redundancy": lambda: DDPStrategy(zero_redundancy=True),
    }[name]()


OPTIONS = [
    "plain",
    "unused_without_flag",
    "static_graph",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "fp16_hook",
    "fp16_wrapper",
    "bf16_hook",
    "powersgd",
    "post_local_sgd",
    "zero_redundancy",
]


WITH_UNUSED = ("unused_without_flag", "find_unused_parameters")


class Model(nn.Module):
    """With ``unused=True`` one layer gets no gradient: DDP then needs ``find_unused_parameters=True``."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.unused = nn.Linear(2, 2) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train(acc: Accelerator, rank: int, unused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model(unused)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = acc.setup(model, optimizer)
    for step in range(6):
        torch.manual_seed(10 * step + rank)
        acc.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _try_option(name: str, rank: int, tmp: Path) -> dict:
    acc = Accelerator(accelerator="cpu", strategy=_strategy(name), devices=2)
    acc.launch()
    try:
        model, optimizer = _train(acc, rank, unused=name in WITH_UNUSED)
    except (ValueError, TypeError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    ddp = model._forward_module
    result = {
        "params": [p.detach().clone() for p in model.module.net.parameters()],
        "ddp": {
            k: getattr(ddp, k) for k in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters")
        },
        "optimizer": type(optimizer.optimizer).__name__,
    }
    if name == "zero_redundancy":
        result["local_params"] = sum(len(g["params"]) for g in optimizer.optimizer.optim.param_groups)
        acc.save(tmp / "zero.pt", {"model": model, "optimizer": optimizer})
        acc.load(tmp / "zero.pt", {"model": model, "optimizer": optimizer})
        result["saved_state_entries"] = len(
            torch.load(tmp / "zero.pt", weights_only=True)["state"]["optimizer"]["state"]
        )
    return result


def _all_options(rank: int, tmp: str) -> dict:
    return {name: _try_option(name, rank, Path(tmp)) for name in OPTIONS}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all_options, 2, str(tmp_path_factory.mktemp("ddp_options")), timeout=170)


def _trained(results: list[dict], name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert all(torch.isfinite(p).all() for p in result["params"])
        for a, b in zip(result["params"], per_rank[0]["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank} differs from rank 0"
    torch.manual_seed(0)
    initial = Model()
    assert not torch.equal(per_rank[0]["params"][0], initial.net[0].weight), "the model did not train"
    return per_rank


@pytest.mark.parametrize("name", ["static_graph", "gradient_as_bucket_view", "find_unused_parameters"])
def test_ddp_arguments_pass_through_and_train(results, name):
    for result in _trained(results, name):
        assert result["ddp"][name] is True


def test_without_find_unused_parameters_ddp_reports_the_unused_parameter(results):
    for result in (r["unused_without_flag"] for r in results):
        assert "find_unused_parameters=True" in result["error"]


@pytest.mark.parametrize("name", ["fp16_hook", "fp16_wrapper", "powersgd", "post_local_sgd"])
def test_communication_hooks_train(results, name):
    _trained(results, name)


def test_fp16_compression_stays_close_to_full_precision(results):
    fp16, exact = _trained(results, "fp16_hook")[0], _trained(results, "plain")[0]
    for a, b in zip(fp16["params"], exact["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)


def test_post_local_sgd_wraps_the_optimizer(results):
    assert all(r["post_local_sgd"]["optimizer"] == "PostLocalSGDOptimizer" for r in results)


def test_bf16_compression_on_gloo_raises_a_clear_error_at_setup(results):
    for result in (r["bf16_hook"] for r in results):
        assert result["error"].startswith("ValueError: DDPStrategy was given bf16_compress_hook")
        assert "fp16_compress_hook" in result["error"]


def test_zero_redundancy_shards_optimizer_state_and_matches_plain_ddp(results):
    per_rank = _trained(results, "zero_redundancy")
    exact = _trained(results, "plain")[0]
    for result in per_rank:
        assert result["optimizer"] == "ZeroRedundancyOptimizer"
        assert 0 < result["local_params"] < 4  # each rank steps only its shard of the 4 tensors
        assert result["saved_state_entries"] == 4  # the checkpoint holds the consolidated state
        for a, b in zip(result["params"], exact["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_options_that_need_each_other_are_checked_at_construction():
    with pytest.raises(ValueError, match="without `comm_hook`"):
        DDPStrategy(comm_state=object())
    with pytest.raises(ValueError, match="PostLocalSGDState"):
        DDPStrategy(comm_hook=default_hooks.allreduce_hook, model_averaging_period=2)
