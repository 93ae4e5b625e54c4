"""FSDP strategy in one process: option validation, block detection, policies, misuse errors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from minifabric import Accelerator, FSDPStrategy
from minifabric.precision import precision_from_string
from minifabric.resolve import strategy_from_string
from minifabric.strategies.fsdp_wrap import (
    inner_policy,
    mixed_precision_policy,
    offload_policy,
    repeated_block_classes,
    select_blocks,
)
from tests.models import GPT, Block, GPTConfig, NoInit, gpt_loss, token_batches


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "ZERO3"}, ValueError, "sharding_strategy='ZERO3'"),
        ({"state_dict_type": "local"}, ValueError, "state_dict_type='local'"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload"),
        ({"mixed_precision": torch.bfloat16}, TypeError, "MixedPrecisionPolicy"),
        ({"auto_wrap_policy": [Block]}, TypeError, "auto_wrap_policy"),
        ({"activation_checkpointing_policy": {"Block"}}, TypeError, "activation_checkpointing_policy"),
    ],
)
def test_bad_options_raise_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_options_are_keyword_only_and_strings_resolve() -> None:
    with pytest.raises(TypeError):
        FSDPStrategy({Block})  # type: ignore[misc]
    assert strategy_from_string("fsdp_cpu_offload", 2).cpu_offload is True
    assert FSDPStrategy().state_dict_type == "sharded"


def test_repeated_blocks_are_found_top_down() -> None:
    assert repeated_block_classes(GPT()) == {Block}
    mlp = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert repeated_block_classes(mlp) == {nn.Linear}
    assert repeated_block_classes(nn.Linear(2, 2)) == set()


def test_select_blocks_orders_children_first_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    model = GPT(GPTConfig(n_layer=3))
    with caplog.at_level(logging.INFO, logger="minifabric.strategies.fsdp_wrap"):
        blocks = select_blocks(model, None)
    assert blocks == list(model.blocks)[::-1]
    assert "Block" in caplog.text
    assert select_blocks(model, lambda m, name: name == "blocks.1") == [model.blocks[1]]
    untied = GPT(GPTConfig(tied=False))
    nested = select_blocks(untied, {Block, nn.Linear})
    assert nested.index(untied.blocks[0].fc) < nested.index(untied.blocks[0])


def test_policy_matching_nothing_or_a_tied_module_raises() -> None:
    with pytest.raises(ValueError, match=r"auto_wrap_policy=\{Conv2d\} matched no submodule of GPT"):
        select_blocks(GPT(), {nn.Conv2d})
    with pytest.raises(ValueError, match="tied weights"):
        select_blocks(GPT(), {nn.Embedding})
    assert GPT().wte not in select_blocks(GPT(), None)


def test_precision_maps_to_mixed_precision_policy() -> None:
    bf16 = mixed_precision_policy(precision_from_string("bf16-mixed", "cpu"))
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    assert inner_policy(bf16).output_dtype is None
    assert mixed_precision_policy(precision_from_string("16-mixed", "cpu")).param_dtype == torch.float16
    assert mixed_precision_policy(precision_from_string("bf16-true", "cpu")) == MixedPrecisionPolicy()
    override = MixedPrecisionPolicy(param_dtype=torch.float16)
    strategy = FSDPStrategy(mixed_precision=override)
    assert strategy.mp_policy is override


def test_cpu_offload_on_cpu_does_not_pin_memory() -> None:
    policy = offload_policy(True, "cpu")
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False
    assert not isinstance(offload_policy(False, "cpu"), CPUOffloadPolicy)


# ---- one-process FSDP (a process group of one) -----------------------------------------------


def _accelerator(**kwargs: object) -> Accelerator:
    acc = Accelerator(accelerator="cpu", strategy=FSDPStrategy(**kwargs), devices=1)  # type: ignore[arg-type]
    acc.launch()
    return acc


def test_one_process_fsdp_trains_and_rebinds_the_optimizer() -> None:
    acc = _accelerator()
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.setup(model, optimizer)
    before = model.module.blocks[0].fc.weight.full_tensor().clone()
    acc.backward(gpt_loss(model, token_batches(1, 2, GPTConfig())[0]))
    optimizer.step()
    assert not torch.equal(before, model.module.blocks[0].fc.weight.full_tensor())


def test_policy_matching_nothing_raises_at_setup() -> None:
    acc = _accelerator(auto_wrap_policy={nn.Conv2d})
    with pytest.raises(ValueError, match="matched no submodule"):
        acc.setup(GPT())


def test_parameter_never_initialized_raises_under_empty_init() -> None:
    acc = _accelerator()
    with acc.init_module(empty_init=True):
        model = NoInit()
    with pytest.raises(ValueError, match=r"parameter 'weight' of NoInit.*never initialized"):
        acc.setup(model)


def test_optimizer_over_another_model_raises() -> None:
    acc = _accelerator()
    model = GPT()
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the GPT|holds no parameter"):
        acc.setup(model, optimizer)


def test_setup_twice_shards_once() -> None:
    acc = _accelerator()
    model = GPT()
    wrapped = acc.setup(model)
    again = acc.setup(model)  # as Fabric allows: the raw model again gives the same sharded model
    assert again.module is model and again._forward_module is wrapped._forward_module
    with pytest.raises(ValueError, match="already set up"):
        acc.setup(wrapped)


def test_mesh_before_launch_raises() -> None:
    with pytest.raises(RuntimeError, match=r"acc.launch\(\)"):
        FSDPStrategy().mesh  # noqa: B018


@pytest.mark.parametrize("stepped", [False, True])
def test_an_optimizer_holding_state_before_setup_keeps_it_laid_out_like_the_new_parameters(
    stepped: bool,
) -> None:
    """Adagrad creates its state in the constructor (and any optimizer has state once stepped)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1, initial_accumulator_value=0.5)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    batches = [torch.randn(2, 4) for _ in range(3)]
    if stepped:
        for m, o in ((reference, ref_opt), (model, optimizer)):
            m(batches[0]).sum().backward()
            o.step()
            o.zero_grad()
    acc = _accelerator()
    model, optimizer = acc.setup(model, optimizer)
    for batch in batches[1:]:
        reference(batch).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        acc.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
    for (name, expected), actual in zip(
        reference.state_dict().items(), model.module.parameters(), strict=True
    ):
        assert torch.allclose(actual.full_tensor(), expected, rtol=0, atol=1e-6), name


def test_an_optimizer_with_state_over_meta_parameters_is_refused_naming_the_fix() -> None:
    acc = _accelerator()
    with acc.init_module(empty_init=True):
        model = nn.Linear(4, 4)
    optimizer = torch.optim.Adagrad(model.parameters())  # its 'sum' on the meta device
    with pytest.raises(
        RuntimeError, match=r"state 'sum' of shape \(4, 4\) on the meta device.*Adagrad\(model"
    ):
        acc.setup(model, optimizer)


def test_optimizer_state_in_another_dtype_than_the_set_up_parameters_is_refused() -> None:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1, precision="bf16-true")
    acc.launch()
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adagrad(model.parameters())  # float32 state; setup makes the weights bf16
    params = list(model.parameters())
    with pytest.raises(
        RuntimeError, match=r"'sum' in torch.float32 for a parameter that setup made torch.bfloat16"
    ):
        acc.setup(model, optimizer)
    assert list(optimizer.state) == params and optimizer.param_groups[0]["params"] == params  # nothing moved


def test_a_mesh_read_before_launch_names_the_missing_launch():
    from minifabric.strategies.model_parallel import ModelParallelStrategy

    with pytest.raises(RuntimeError, match=r"The FSDP device mesh needs the process group\. Call `acc\.launch\(\)`"):
        _ = FSDPStrategy().mesh
    with pytest.raises(RuntimeError, match=r"The device mesh needs the process group\. Call `acc\.launch\(\)`"):
        _ = ModelParallelStrategy(lambda model, mesh: model).device_mesh


def test_an_optimizer_over_parameters_of_no_set_up_model_is_refused() -> None:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    model = acc.setup_module(nn.Linear(4, 4))
    head = nn.Linear(4, 2)  # never set up: each rank would step its own copy
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds 2 parameter\(s\) that no model set up with FSDPStrategy owns"):
        acc.setup_optimizers(optimizer)
    assert optimizer.param_groups[0]["params"] == list(head.parameters())  # nothing moved
    mixed = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds 2 parameter\(s\) that are not parameters of the"):
        acc.setup_optimizers(mixed)
    # over the set-up model's own parameters, it is accepted
    acc.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
