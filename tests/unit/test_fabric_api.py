"""Fabric's names on one process: plugins, loggers, callbacks, seeding, to_device, forward methods,
lightning utilities given an Accelerator, and FSDPStrategy's FSDP1 keyword arguments."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from minifabric import Accelerator, FSDPStrategy, seed_everything


class Net(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        assert torch.is_autocast_enabled("cpu") == self.expect_autocast
        return self(x).sum()

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    expect_autocast = False


def test_plugins_take_a_precision_and_a_cluster_environment():
    from lightning_fabric.plugins import HalfPrecision, MixedPrecision
    from lightning_fabric.plugins.environments import LightningEnvironment

    environment = LightningEnvironment()
    acc = Accelerator(accelerator="cpu", plugins=[MixedPrecision("bf16-mixed", "cpu"), environment])
    assert acc.precision.name == "bf16-mixed"
    assert acc.strategy.environment is environment
    assert Accelerator(accelerator="cpu", plugins="bf16-true").precision.name == "bf16-true"
    assert Accelerator(accelerator="cpu", plugins=HalfPrecision("bf16-true")).precision.name == "bf16-true"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"plugins": object()}, TypeError, "plugins= got <object"),
        ({"plugins": "bf16-mixed", "precision": "16-true"}, ValueError, "disagree"),
        ({"plugins": ["bf16-mixed", "16-mixed"]}, ValueError, "two precisions"),
        ({"loggers": [object()]}, TypeError, "log_metrics"),
        ({"callbacks": "on_epoch_end"}, TypeError, "callbacks= takes an object"),
    ],
)
def test_bad_plugins_loggers_callbacks_raise(kwargs: dict, error: type, match: str):
    with pytest.raises(error, match=match):
        Accelerator(accelerator="cpu", **kwargs)


def test_log_goes_to_every_logger_as_scalars_and_call_reaches_callbacks():
    class Logger:
        def __init__(self) -> None:
            self.logged: list = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.logged.append((metrics, step))

    class Callback:
        def __init__(self) -> None:
            self.args: list = []

        def on_epoch_end(self, epoch: int, *, loss: float) -> None:
            self.args.append((epoch, loss))

    first, second, callback = Logger(), Logger(), Callback()
    acc = Accelerator(accelerator="cpu", loggers=[first, second], callbacks=callback)
    acc.log("loss", torch.tensor(0.5), step=3)
    acc.log_dict({"a": 1, "b": torch.tensor([2.0])})
    assert first.logged == second.logged == [({"loss": 0.5}, 3), ({"a": 1, "b": 2.0}, None)]
    assert acc.logger is first and acc.loggers == [first, second]
    acc.call("on_epoch_end", 1, loss=0.25, ignored=True)
    acc.call("no_such_hook")
    assert callback.args == [(1, 0.25)]
    with pytest.raises(ValueError, match="shape"):
        acc.log("vector", torch.ones(3))
    with pytest.raises(RuntimeError, match="No logger"):
        Accelerator(accelerator="cpu").logger  # noqa: B018


def test_to_device_moves_modules_and_collections():
    acc = Accelerator(accelerator="cpu")
    module = nn.Linear(2, 2)
    assert acc.to_device(module) is module
    moved = acc.to_device({"x": torch.ones(2), "n": [torch.zeros(1)], "s": "text"})
    assert moved["x"].device == acc.device and moved["s"] == "text"


@pytest.mark.parametrize("seeder", ["minifabric", "lightning"])
def test_seed_everything_before_any_accelerator_seeds_the_shuffling(seeder: str):
    from lightning_fabric.utilities.seed import seed_everything as lightning_seed_everything

    (seed_everything if seeder == "minifabric" else lightning_seed_everything)(7)
    acc = Accelerator(accelerator="cpu")
    data = TensorDataset(torch.arange(32))
    loader = acc.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    order = torch.cat([batch[0] for batch in loader]).tolist()
    assert order == list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7))
    assert order != list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))


def test_step_methods_run_in_the_precision_context_and_others_warn_once():
    acc = Accelerator(accelerator="cpu", precision="bf16-mixed")
    model = acc.setup(Net())
    model.module.expect_autocast = True
    assert model.training_step(torch.ones(1, 4)).dtype == torch.float32  # output converted back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(torch.ones(1, 4))
        model.generate(torch.ones(1, 4))
    assert [str(w.message).count("mark_forward_method") for w in caught] == [1]
    model.mark_forward_method("generate")
    assert model.generate(torch.ones(1, 4)).dtype == torch.float32
    with pytest.raises(ValueError, match="not a method"):
        model.mark_forward_method("weight")
    with pytest.raises(ValueError, match="forward"):
        model.mark_forward_method("forward")


def test_all_reduce_of_an_integer_tensor_mean_raises_instead_of_truncating():
    acc = Accelerator(accelerator="cpu")
    tensor = torch.tensor([1.0, 2.0])
    assert acc.all_reduce(tensor) is tensor
    with pytest.raises(TypeError, match=r"t\.double\(\)"):
        acc.all_reduce(torch.tensor([3]))
    assert acc.all_reduce(torch.tensor([3]), reduce_op="sum").tolist() == [3]


def test_lightning_throughput_monitor_reads_the_precision_of_an_accelerator():
    from lightning_fabric.utilities.throughput import ThroughputMonitor, _plugin_to_compute_dtype

    acc = Accelerator(accelerator="cpu", precision="bf16-mixed")
    acc.launch()
    ThroughputMonitor(acc)
    assert _plugin_to_compute_dtype(acc.precision) == torch.bfloat16
    assert repr(acc.precision) == "MixedPrecision('bf16-mixed')"
    assert type(pickle.loads(pickle.dumps(acc.precision))).__mro__[1].__module__ == "minifabric.precision"
    true16 = Accelerator(accelerator="cpu", precision="bf16-true")
    true16._validate_launched()
    assert _plugin_to_compute_dtype(true16.precision) == torch.bfloat16


def test_fsdp1_keyword_arguments_map_or_warn_once():
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = FSDPStrategy(
            cpu_offload=CPUOffload(offload_params=True),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            activation_checkpointing=[nn.Linear],
            sync_module_states=True,
            limit_all_gathers=True,
            use_orig_params=True,
            forward_prefetch=True,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        )
    assert len(caught) == 1
    for name in ("limit_all_gathers", "use_orig_params", "forward_prefetch", "backward_prefetch"):
        assert name in str(caught[0].message)
    assert strategy.cpu_offload is True and strategy.sharding_strategy == "SHARD_GRAD_OP"
    assert strategy.mixed_precision.param_dtype == torch.bfloat16
    assert strategy.auto_wrap_policy == {nn.Linear} == strategy.activation_checkpointing_policy
    assert strategy.sync_module_states is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDPStrategy()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"limit_all_gather": True}, TypeError, "unknown keyword arguments 'limit_all_gather'"),
        ({"param_init_fn": lambda m: m}, ValueError, "init_module"),
        ({"auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True}, TypeError, "FSDP1"),
    ],
)
def test_unknown_or_unsupported_fsdp_arguments_raise(kwargs: dict, error: type, match: str):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_fabric_hooks_after_setup_and_after_each_optimizer_step():
    class Hooks:
        def __init__(self) -> None:
            self.seen: list = []

        def on_after_setup(self, fabric: Accelerator, module: nn.Module) -> None:
            self.seen.append(("setup", fabric, module))

        def on_after_optimizer_step(self, strategy: object, optimizer: torch.optim.Optimizer) -> None:
            self.seen.append(("step", strategy, optimizer))

    hooks = Hooks()
    acc = Accelerator(accelerator="cpu", callbacks=hooks)
    module = nn.Linear(2, 1)
    model, optimizer = acc.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    acc.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    assert hooks.seen == [("setup", acc, model), ("step", acc.strategy, optimizer.optimizer)]
