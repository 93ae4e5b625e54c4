"""The memory estimator in one process: the block extrapolation, the advice, the CLI, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minifabric import estimate_memory
from minifabric._torch import fake_tensor_mode, fake_world
from minifabric.cli import main
from minifabric.estimate import _advice, _estimate, _extrapolated, _trace, model_factory, parse_bytes
from tests.models import GPT, GPTConfig

SMALL = {"vocab_size": 512, "block_size": 32, "n_layer": 3, "n_head": 2, "n_embd": 64, "tied": False}


def make_gpt(**kwargs: object) -> GPT:
    return GPT(GPTConfig(**kwargs))  # type: ignore[arg-type]


def test_extrapolating_from_three_and_four_blocks_equals_tracing_all_six() -> None:
    six = {**SMALL, "n_layer": 6}
    run = dict(
        strategy="fsdp", world_size=2, precision="32-true", optimizer="adamw",
        batch_shape=(2, 32), input_dtype=torch.long, activation_checkpointing=False,
    )  # fmt: skip
    factory = model_factory(make_gpt, six)
    full = _estimate(_trace(factory, run, None), run)
    assert _extrapolated(factory, run) == full
    assert full.parameters > 0 and full.communication > 0 and full.activations > 0


def test_budget_gives_the_largest_world_size_that_does_not_fit() -> None:
    tight = estimate_memory(make_gpt, model_kwargs=SMALL, world_size=2, batch_shape=(2, 32))
    budget = int(tight.total * 0.8)
    est = estimate_memory(make_gpt, model_kwargs=SMALL, world_size=2, batch_shape=(2, 32), budget=budget)
    n = est.largest_world_size_not_fitting
    assert n is not None and n >= 2
    assert est.at_world_size(n) > budget >= est.at_world_size(n + 1)
    assert f"FULL_SHARD on >= {n + 1} ranks" in est.suggestion
    ddp = estimate_memory(
        make_gpt, model_kwargs=SMALL, strategy="ddp", world_size=2, batch_shape=(2, 32), budget=budget
    )
    assert ddp.largest_world_size_not_fitting == -1 and "FULL_SHARD" in ddp.suggestion
    assert ddp.communication > 0  # DDP's gradient buckets
    assert _advice(tight, tight, 2**30, False) == (
        None,
        f"fits: {tight.total / 2**30:.2f} GiB of 1.00 GiB per device.",
    )


def test_cli_reads_an_import_path_and_a_hugging_face_config(tmp_path, capsys) -> None:
    main(["estimate", "tests.models:GPT", "--strategy", "single", "--batch-shape", "2,8", "--budget", "1GiB"])
    out = capsys.readouterr().out
    assert "optimizer state" in out and "fits" in out
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    main(["estimate", str(tmp_path / "config.json"), "--world-size", "4", "--precision", "bf16-mixed",
          "--kwarg", "num_hidden_layers=2", "--batch-shape", "1,16", "--activation-checkpointing"])  # fmt: skip
    assert "fsdp x 4" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "zero3"}, "strategy='zero3'"),
        ({"world_size": 0}, "world_size"),
        ({"strategy": "single", "world_size": 2}, "strategy='ddp'"),
        ({"optimizer": "lion"}, "optimizer='lion'"),
        ({"batch_shape": (2, 0)}, "batch_shape"),
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"budget": "lots"}, "budget='lots'"),
    ],
)
def test_bad_input_raises_before_any_work(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate_memory(make_gpt, **kwargs)


def test_a_bad_model_raises_and_sizes_parse() -> None:
    with pytest.raises(ValueError, match="import path"):
        estimate_memory("no_such_model")
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("24GB") == 24 * 10**9


class _FailsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("forward fails")


def test_an_existing_process_group_is_refused_left_alone_and_the_fake_one_is_gone_afterwards() -> None:
    """The estimator's own (fake) process group never replaces a real one and never outlives the call."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        users = dist.group.WORLD
        with pytest.raises(RuntimeError, match=r"already initialized. Estimate before `acc.launch\(\)`"):
            estimate_memory(make_gpt, model_kwargs=SMALL, world_size=4, batch_shape=(2, 8))
        assert dist.group.WORLD is users and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        total = torch.ones(2)
        dist.all_reduce(total)  # the user's group still communicates
        assert total.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    estimate_memory(make_gpt, model_kwargs=SMALL, world_size=4, batch_shape=(2, 8))
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError, match="forward fails"):  # fails inside the fake world
        estimate_memory(_FailsInForward, world_size=2, batch_shape=(2, 4), input_dtype=torch.float32)
    assert not dist.is_initialized()


def test_fsdp_estimate_holds_the_local_shards_that_fully_shard_leaves() -> None:
    """Per-rank parameters are the local shards of the DTensors the strategy made (uneven dim-0 chunks)."""
    from minifabric.estimate import _set_up
    from minifabric.precision import precision_from_string

    run = dict(strategy="fsdp", world_size=3, activation_checkpointing=False)
    model_kwargs = {**SMALL, "n_embd": 64, "vocab_size": 500}  # 500 rows over 3 ranks: 167, 167, 166
    mode = fake_tensor_mode()
    with fake_world(3):
        model, _ = _set_up(
            lambda: make_gpt(**model_kwargs), precision_from_string("32-true", "cpu"), run, mode
        )
        with mode:
            local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    with torch.device("meta"):
        full = {name: tuple(p.shape) for name, p in make_gpt(**model_kwargs).named_parameters()}
    assert local.keys() == full.keys()
    for name, shape in full.items():
        assert local[name] == (-(-shape[0] // 3), *shape[1:]), name  # rank 0 holds the first, largest chunk


def test_model_parallel_estimate_shards_over_both_dimensions(capsys) -> None:
    """(dp, tp) = (2, 2): the plan's and FSDP's shards both count; the CLI takes the plan by import path."""
    from tests.tp_models import TPTransformer, parallelize

    n = sum(p.numel() for p in TPTransformer().parameters())
    two_d = estimate_memory(
        TPTransformer,
        strategy="model_parallel",
        world_size=4,
        tensor_parallel_size=2,
        parallelize_fn=parallelize,
        batch_shape=(2, 8),
    )
    # AdamW: two float32 moments per parameter, each rank holding a quarter (uneven shards: a little more)
    assert 2 * 4 * n / 4 <= two_d.optimizer_state <= 1.1 * 2 * 4 * n / 4
    assert two_d.strategy == "model_parallel" and two_d.world_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        estimate_memory(TPTransformer, strategy="model_parallel", world_size=4, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs parallelize_fn"):
        estimate_memory(TPTransformer, strategy="model_parallel", world_size=4, tensor_parallel_size=2)
    main(["estimate", "tests.tp_models:TPTransformer", "--strategy", "model_parallel", "--world-size", "4",
          "--tensor-parallel-size", "2", "--parallelize", "tests.tp_models:parallelize", "--batch-shape", "2,8"])  # fmt: skip
    assert "model_parallel x 4" in capsys.readouterr().out


@pytest.mark.parametrize(("strategy", "world_size"), [("single", 1), ("fsdp", 2)])
def test_a_true_precision_stores_the_parameters_in_its_dtype(strategy: str, world_size: int) -> None:
    """``"bf16-true"``: the model is built in bfloat16, so its parameters and optimizer state take half."""
    run = dict(model_kwargs=SMALL, strategy=strategy, world_size=world_size, batch_shape=(2, 32))
    fp32 = estimate_memory(make_gpt, precision="32-true", **run)  # type: ignore[arg-type]
    bf16 = estimate_memory(make_gpt, precision="bf16-true", **run)  # type: ignore[arg-type]
    assert bf16.optimizer_state == pytest.approx(fp32.optimizer_state / 2, rel=0.01)
    if strategy == "single":
        assert bf16.parameters == pytest.approx(fp32.parameters / 2, rel=0.01)
