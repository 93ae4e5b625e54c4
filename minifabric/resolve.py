"""Turn the Accelerator's arguments (and ``minifabric run``'s settings) into concrete parts, in one place."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from minifabric.environment import LocalEnvironment, detect_cluster_environment, local_world_size
from minifabric.precision import PRECISIONS, Precision, precision_from_string
from minifabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from lightning_fabric.plugins.environments import ClusterEnvironment

AcceleratorStr = Literal["auto", "cpu", "cuda"]
StrategyStr = Literal["auto", "single", "ddp", "fsdp", "fsdp_cpu_offload"]
ACCELERATORS: tuple[str, ...] = get_args(AcceleratorStr)
STRATEGIES: tuple[str, ...] = get_args(StrategyStr)

#: environment variables through which ``minifabric run`` passes its flags to ``Accelerator()``
ENV_SETTINGS = {
    "accelerator": "MINIFABRIC_ACCELERATOR",
    "strategy": "MINIFABRIC_STRATEGY",
    "devices": "MINIFABRIC_DEVICES",
    "num_nodes": "MINIFABRIC_NUM_NODES",
    "precision": "MINIFABRIC_PRECISION",
}
DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": "32-true",
}


@dataclass
class Resolved:
    """The parts an Accelerator is built from."""

    environment: ClusterEnvironment | LocalEnvironment
    device: torch.device
    num_processes: int
    num_nodes: int
    precision: Precision
    strategy: Strategy


def apply_cli_settings(args: dict[str, Any]) -> dict[str, Any]:
    """Fill arguments left at their defaults from ``minifabric run``'s flags; explicit arguments win."""
    out = dict(args)
    for name, var in ENV_SETTINGS.items():
        value = os.environ.get(var)
        if value is None:
            continue
        if name in ("devices", "num_nodes") and value.isdigit():
            parsed: Any = int(value)
        else:
            parsed = value
        if isinstance(out[name], str) or isinstance(out[name], int):
            if out[name] == DEFAULTS[name]:
                out[name] = parsed
            elif out[name] != parsed:
                warnings.warn(
                    f"`minifabric run` set {name}={parsed!r} but the script passes Accelerator({name}={out[name]!r});"
                    " the script's value is used.",
                    stacklevel=3,
                )
    return out


def _check_choice(name: str, value: Any, choices: tuple[str, ...], example: str) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"Unknown {name}={value!r}. Choose one of {', '.join(map(repr, choices))}, e.g. Accelerator({example})."
        )


def _accelerator_type(accelerator: str) -> str:
    _check_choice("accelerator", accelerator, ACCELERATORS, 'accelerator="cpu"')
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            'accelerator="cuda" was requested but CUDA is not available. Use Accelerator(accelerator="cpu").'
        )
    return accelerator


def _device_indices(devices: Any, accelerator: str) -> list[int] | None:
    """Indices for a list of devices, else None; validates ``devices``."""
    if isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(d, int) and d >= 0 for d in devices):
            raise ValueError(
                f"devices={devices!r} must be a non-empty list of device indices, e.g. devices=[0, 1]."
            )
        return list(devices)
    if devices == "auto" or (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1):
        return None
    raise ValueError(f'devices={devices!r} is not valid. Pass a positive int, a list of indices, or "auto".')


def resolve(
    *,
    accelerator: Any,
    strategy: Any,
    devices: Any,
    num_nodes: Any,
    precision: Any,
) -> Resolved:
    """Validate the arguments and build environment, device, precision plugin and strategy."""
    device_type = _accelerator_type(accelerator)
    _check_choice("precision", precision, PRECISIONS, 'precision="bf16-mixed"')
    if not isinstance(strategy, Strategy):
        _check_choice("strategy", strategy, STRATEGIES, 'strategy="ddp"')
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive int, e.g. Accelerator(num_nodes=2).")
    indices = _device_indices(devices, device_type)
    environment = detect_cluster_environment()
    if isinstance(environment, LocalEnvironment) and environment.creates_processes_externally:
        environment.set_world_size(int(os.environ.get("WORLD_SIZE", 1)))

    if environment.creates_processes_externally:
        num_processes = local_world_size(environment, num_nodes)
        expected = len(indices) if indices is not None else devices
        if isinstance(expected, int) and expected * num_nodes != environment.world_size():
            raise ValueError(
                f"{type(environment).__name__} started {environment.world_size()} processes, but"
                f" Accelerator(devices={devices!r}, num_nodes={num_nodes!r}) expects"
                f' {expected * num_nodes}. Pass devices="auto" to take the launcher\'s numbers.'
            )
    else:
        if num_nodes > 1:
            raise ValueError(
                f"num_nodes={num_nodes} needs processes started on every node. Launch with"
                f" `minifabric run --num-nodes {num_nodes} --node-rank R --main-address HOST script.py`,"
                " torchrun, or srun on SLURM."
            )
        if indices is not None:
            num_processes = len(indices)
        elif devices == "auto":
            num_processes = torch.cuda.device_count() if device_type == "cuda" else 1
        else:
            num_processes = devices

    local_rank = environment.local_rank()
    if device_type == "cuda":
        index = indices[local_rank] if indices is not None else local_rank
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")

    world_size = num_processes * num_nodes
    precision_plugin = precision_from_string(precision, device_type)
    strategy_obj = strategy if isinstance(strategy, Strategy) else strategy_from_string(strategy, world_size)
    strategy_obj.connect(
        environment=environment,
        device=device,
        num_processes=num_processes,
        num_nodes=num_nodes,
        precision=precision_plugin,
    )
    return Resolved(environment, device, num_processes, num_nodes, precision_plugin, strategy_obj)


def strategy_from_string(name: str, world_size: int) -> Strategy:
    """Build the strategy for a strategy string."""
    from minifabric.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    if name == "auto":
        name = "single" if world_size == 1 else "ddp"
    if name == "single":
        if world_size > 1:
            raise ValueError(
                f'strategy="single" runs one process, but {world_size} were requested. Use strategy="ddp"'
                ' or strategy="fsdp", or Accelerator(devices=1).'
            )
        return SingleDeviceStrategy()
    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp":
        return FSDPStrategy()
    return FSDPStrategy(cpu_offload=True)
