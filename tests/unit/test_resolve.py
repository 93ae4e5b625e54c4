"""Resolution of the Accelerator's arguments: strings, devices, ``minifabric run`` settings, clusters."""

import warnings
from typing import get_args

import pytest
import torch
from lightning_fabric.plugins.environments import (
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from minifabric import Accelerator, DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from minifabric.precision import PRECISIONS
from minifabric.resolve import ACCELERATORS, STRATEGIES, canonical
from minifabric.runtime.environment import LocalEnvironment, detect_cluster_environment
from minifabric.runtime.launcher import JoinLauncher, LocalLauncher

_CLUSTER_VARS = (
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "SLURM_NTASKS",
    "LSB_JOBID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    """Tests start outside any cluster and without ``minifabric run`` settings."""
    for var in (*_CLUSTER_VARS, "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var in ("ACCELERATOR", "STRATEGY", "DEVICES", "NUM_NODES", "PRECISION"):
        monkeypatch.delenv(f"MINIFABRIC_{var}", raising=False)


@pytest.mark.parametrize(
    ("kwargs", "valid"),
    [
        ({"strategy": "deepspeed"}, STRATEGIES),
        ({"precision": "fp8"}, PRECISIONS),
        ({"accelerator": "tpu"}, ACCELERATORS),
    ],
)
def test_unknown_string_lists_the_valid_ones(kwargs, valid):
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=f"Unknown {name}='{value}'") as info:
        Accelerator(**kwargs)
    for choice in valid:
        assert repr(choice) in str(info.value)


@pytest.mark.parametrize(
    ("devices", "strategy_cls", "processes"), [(1, SingleDeviceStrategy, 1), (2, DDPStrategy, 2)]
)
def test_auto_strategy_is_single_for_one_device_and_ddp_for_more(devices, strategy_cls, processes):
    acc = Accelerator(accelerator="cpu", devices=devices)
    assert type(acc.strategy) is strategy_cls
    assert acc.strategy.num_processes == processes
    expected_launcher = LocalLauncher if processes > 1 else JoinLauncher
    assert type(acc.strategy.launcher) is expected_launcher


def test_devices_auto_is_one_process_on_cpu():
    acc = Accelerator(accelerator="cpu", devices="auto")
    assert acc.strategy.num_processes == 1
    assert acc.device == torch.device("cpu")


def test_devices_list_counts_its_entries():
    assert Accelerator(accelerator="cpu", devices=[0, 1]).strategy.num_processes == 2


@pytest.mark.parametrize("devices", [0, -1, "two", [], [-1], True, 1.5])
def test_invalid_devices_raise(devices):
    with pytest.raises(ValueError, match="devices="):
        Accelerator(accelerator="cpu", devices=devices)


@pytest.mark.parametrize("num_nodes", [0, -2, "2", True])
def test_invalid_num_nodes_raise(num_nodes):
    with pytest.raises(ValueError, match="num_nodes="):
        Accelerator(accelerator="cpu", num_nodes=num_nodes)


def test_several_nodes_without_a_launcher_raise_with_the_command():
    with pytest.raises(ValueError, match="minifabric run --num-nodes 2"):
        Accelerator(accelerator="cpu", num_nodes=2)


def test_single_strategy_with_several_devices_raises():
    with pytest.raises(ValueError, match='strategy="single" runs one process'):
        Accelerator(accelerator="cpu", strategy="single", devices=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_cuda_raises():
    with pytest.raises(ValueError, match='accelerator="cpu"'):
        Accelerator(accelerator="cuda")


def test_strategy_instance_is_used_as_given():
    strategy = DDPStrategy(static_graph=True)
    assert Accelerator(accelerator="cpu", strategy=strategy, devices=2).strategy is strategy


def test_cli_settings_fill_defaults(monkeypatch):
    monkeypatch.setenv("MINIFABRIC_DEVICES", "2")
    monkeypatch.setenv("MINIFABRIC_PRECISION", "bf16-mixed")
    monkeypatch.setenv("MINIFABRIC_ACCELERATOR", "cpu")
    acc = Accelerator()
    assert acc.strategy.num_processes == 2
    assert acc.precision.name == "bf16-mixed"
    assert isinstance(acc.strategy, DDPStrategy)


def test_explicit_arguments_win_over_cli_settings_with_a_warning(monkeypatch):
    monkeypatch.setenv("MINIFABRIC_PRECISION", "bf16-mixed")
    with pytest.warns(UserWarning, match="precision='bf16-mixed'.*the script's value is used"):
        acc = Accelerator(accelerator="cpu", precision="64-true")
    assert acc.precision.name == "64-true"


def test_invalid_cli_setting_raises(monkeypatch):
    monkeypatch.setenv("MINIFABRIC_STRATEGY", "horovod")
    with pytest.raises(ValueError, match="Unknown strategy='horovod'"):
        Accelerator(accelerator="cpu")


def test_no_cluster_means_a_local_environment():
    assert type(detect_cluster_environment()) is LocalEnvironment


def _torchrun_env(monkeypatch, rank, local_rank, world_size, local_world_size):
    for name, value in {
        "TORCHELASTIC_RUN_ID": "test",
        "GROUP_RANK": str(rank // local_world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(name, value)


def test_torchrun_is_detected_and_only_joined(monkeypatch):
    _torchrun_env(monkeypatch, rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert type(detect_cluster_environment()) is TorchElasticEnvironment
    acc = Accelerator(accelerator="cpu", num_nodes=2)
    assert (acc.global_rank, acc.local_rank, acc.node_rank, acc.world_size) == (3, 1, 1, 4)
    assert acc.strategy.num_processes == 2
    assert isinstance(acc.strategy, DDPStrategy)
    assert type(acc.strategy.launcher) is JoinLauncher


def test_devices_that_disagree_with_the_launcher_raise(monkeypatch):
    _torchrun_env(monkeypatch, rank=0, local_rank=0, world_size=2, local_world_size=2)
    with pytest.raises(ValueError, match=r'started 2 processes.*expects 3.*devices="auto"'):
        Accelerator(accelerator="cpu", devices=3)


def test_slurm_is_detected(monkeypatch):
    for name, value in {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "1234",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert type(detect_cluster_environment()) is SLURMEnvironment
    acc = Accelerator(accelerator="cpu", devices=2, num_nodes=2)
    assert (acc.global_rank, acc.local_rank, acc.node_rank, acc.world_size) == (2, 0, 1, 4)
    assert type(acc.strategy.launcher) is JoinLauncher


def test_interactive_slurm_is_not_a_cluster(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    assert type(detect_cluster_environment()) is LocalEnvironment


@pytest.mark.parametrize(
    ("precision", "expected", "warns"),
    [
        (16, "16-mixed", True),
        ("16", "16-mixed", True),
        ("bf16", "bf16-mixed", True),
        (32, "32-true", False),
        ("32", "32-true", False),
        (64, "64-true", False),
        ("64", "64-true", False),
        ("BF16-Mixed", "bf16-mixed", False),
        ("16-true", "16-true", False),
    ],
)
def test_fabric_precision_spellings_mean_what_they_mean_in_fabric(precision, expected, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(accelerator="cpu", precision=precision)
    assert acc.precision.name == expected
    notes = [str(w.message) for w in caught if "historical spelling" in str(w.message)]
    assert len(notes) == (1 if warns else 0), notes
    if warns:
        assert f'precision="{expected}"' in notes[0] and "\n" not in notes[0]


def test_fabric_aliases_match_lightning_fabrics_own_conversion():
    from lightning_fabric.connector import _convert_precision_to_unified_args
    from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR_ALIAS

    for alias in (*get_args(_PRECISION_INPUT_INT), *get_args(_PRECISION_INPUT_STR_ALIAS)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert canonical("precision", alias) == _convert_precision_to_unified_args(alias)


@pytest.mark.parametrize(
    ("strategy", "strategy_cls"),
    [("DDP", DDPStrategy), ("Fsdp", FSDPStrategy), (" ddp ", DDPStrategy), ("ddp_spawn", DDPStrategy)],
)
def test_strategy_names_are_case_insensitive(strategy, strategy_cls):
    assert type(Accelerator(accelerator="cpu", devices=2, strategy=strategy).strategy) is strategy_cls


def test_find_unused_parameters_alias_configures_ddp():
    acc = Accelerator(accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true")
    assert isinstance(acc.strategy, DDPStrategy)
    assert acc.strategy.ddp_kwargs.get("find_unused_parameters") is True


def test_accelerator_names_are_case_insensitive():
    assert Accelerator(accelerator="CPU").device == torch.device("cpu")


@pytest.mark.parametrize(
    ("kwargs", "suggested"),
    [
        ({"strategy": "fdsp"}, 'strategy="fsdp"'),
        ({"strategy": "fsdp-cpu-offload"}, 'strategy="fsdp_cpu_offload"'),
        ({"strategy": "deepspeed_stage_3"}, 'strategy="fsdp"'),
        ({"strategy": "dp"}, 'strategy="ddp"'),
        ({"precision": "16mixed"}, 'precision="16-mixed"'),
        ({"precision": "fp16"}, 'precision="16-mixed"'),
        ({"precision": "bfloat16"}, 'precision="bf16-mixed"'),
        ({"precision": "transformer-engine"}, 'precision="bf16-mixed"'),
        ({"accelerator": "cpuu"}, 'accelerator="cpu"'),
    ],
)
def test_unknown_strings_suggest_the_closest_valid_value(kwargs, suggested):
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=f"Unknown {name}={value!r}. Did you mean") as info:
        Accelerator(**kwargs)
    assert suggested in str(info.value)


@pytest.mark.parametrize("precision", [8, 16.0, True, None, "half-mixed-precision"])
def test_other_precisions_raise_listing_the_valid_ones(precision):
    with pytest.raises(ValueError, match="Choose one of '32-true'"):
        Accelerator(accelerator="cpu", precision=precision)


def test_alias_of_the_default_lets_the_cli_setting_decide(monkeypatch):
    monkeypatch.setenv("MINIFABRIC_STRATEGY", "ddp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the script's value is used" warning: DDP is ddp
        acc = Accelerator(accelerator="cpu", devices=2, strategy="DDP")
    assert isinstance(acc.strategy, DDPStrategy)


def test_16_mixed_on_cpu_keeps_float16_with_a_note():
    with pytest.warns(UserWarning, match='Lightning Fabric switches to "bf16-mixed" on CPU'):
        acc = Accelerator(accelerator="cpu", precision="16-mixed")
    assert acc.precision.compute_dtype == torch.float16
