"""Turn the Accelerator's arguments (and ``minifabric run``'s settings) into concrete parts, in one place.

Strings are read the way Lightning Fabric reads them: strategy and accelerator names in any case,
Fabric's precision aliases (``16``, ``"bf16"``, ``32``, ...) with Fabric's meaning. Anything else
raises with the closest valid value.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from minifabric.precision import PRECISIONS, Precision, precision_from_string
from minifabric.runtime.environment import LocalEnvironment, detect_cluster_environment, local_world_size
from minifabric.strategies.strategy import Strategy

if TYPE_CHECKING:
    from lightning_fabric.plugins.environments import ClusterEnvironment

AcceleratorStr = Literal["auto", "cpu", "cuda"]
StrategyStr = Literal["auto", "single", "ddp", "fsdp", "fsdp_cpu_offload"]
ACCELERATORS: tuple[str, ...] = get_args(AcceleratorStr)
STRATEGIES: tuple[str, ...] = get_args(StrategyStr)

#: Fabric's other spellings, read with Fabric's meaning: name -> (ours, note or None). A note is
#: shown (once, as a warning) where Fabric warns or where minifabric reads the name differently.
ALIASES: Mapping[str, Mapping[str, tuple[str, str | None]]] = MappingProxyType({
    "precision": MappingProxyType({
        "32": ("32-true", None),
        "64": ("64-true", None),
        "16": (
            "16-mixed",
            'precision=16 is the historical spelling of "16-mixed"; write precision="16-mixed".',
        ),
        "bf16": (
            "bf16-mixed",
            'precision="bf16" is the historical spelling of "bf16-mixed"; write precision="bf16-mixed".',
        ),
    }),
    "strategy": MappingProxyType({
        "ddp_spawn": ("ddp", None),  # acc.launch(fn) spawns the processes, as Fabric's ddp_spawn does
        "ddp_find_unused_parameters_true": ("ddp", None),  # built as DDPStrategy(find_unused_parameters=True)
    }),
    "accelerator": MappingProxyType({"gpu": ("cuda", None)}),
})

#: names that minifabric refuses, with what to use instead
_HINTS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "precision": MappingProxyType({
        **dict.fromkeys(("fp16", "float16", "half"), '"16-mixed" (or "16-true")'),
        **dict.fromkeys(("bfloat16", "bf-16", "bf16_mixed"), '"bf16-mixed" (or "bf16-true")'),
        **dict.fromkeys(("fp32", "float32", "float", "full"), '"32-true"'),
        **dict.fromkeys(("fp64", "float64", "double"), '"64-true"'),
        **dict.fromkeys(
            ("transformer-engine", "transformer-engine-float16"),
            '"bf16-mixed" (Transformer Engine fp8 is not supported)',
        ),
    }),
    "strategy": MappingProxyType({
        "deepspeed": '"fsdp" (FSDP2 shards parameters, gradients and optimizer state, like ZeRO stage 3)',
        "deepspeed_stage_1": "DDPStrategy(zero_redundancy=True) (ZeRO stage 1: optimizer state sharded)",
        "deepspeed_stage_2": 'FSDPStrategy(sharding_strategy="SHARD_GRAD_OP") (ZeRO stage 2)',
        "deepspeed_stage_2_offload": 'FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True)',
        "deepspeed_stage_3": '"fsdp" (ZeRO stage 3)',
        "deepspeed_stage_3_offload": '"fsdp_cpu_offload"',
        "dp": '"ddp" (one process per device; DataParallel is not supported)',
        "ddp_fork": '"ddp" with acc.launch(fn), fn defined in an importable module (processes are spawned, not forked)',
        "ddp_notebook": '"ddp" with acc.launch(fn), fn defined in an importable module (processes are spawned, not forked)',
        "fsdp1": '"fsdp" (FSDP2; FSDP1 keyword arguments are mapped by FSDPStrategy)',
    }),
    "accelerator": MappingProxyType({
        "gpus": '"cuda"',
        "mps": '"cpu" (Apple MPS is not supported)',
        "tpu": '"cpu" or "cuda" (TPUs are not supported)',
    }),
})

# where Fabric warns and reads "16-mixed" as "bf16-mixed"; here it means what it says
_FP16_ON_CPU = (
    'precision="16-mixed" on CPU runs float16 autocast with a loss scaler (Lightning Fabric switches to'
    ' "bf16-mixed" on CPU); precision="bf16-mixed" is usually faster there and needs no scaler.'
)

#: environment variables through which ``minifabric run`` passes its flags to ``Accelerator()``
ENV_SETTINGS = MappingProxyType({
    "accelerator": "MINIFABRIC_ACCELERATOR",
    "strategy": "MINIFABRIC_STRATEGY",
    "devices": "MINIFABRIC_DEVICES",
    "num_nodes": "MINIFABRIC_NUM_NODES",
    "precision": "MINIFABRIC_PRECISION",
})
DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": "32-true",
})


@dataclass
class Resolved:
    """The parts an Accelerator is built from."""

    environment: ClusterEnvironment | LocalEnvironment
    device: torch.device
    num_processes: int
    num_nodes: int
    precision: Precision
    strategy: Strategy


def launched_by_cli() -> bool:
    """Whether ``minifabric run`` started this process (it passes its flags through ``MINIFABRIC_*``).

    Then, as under ``fabric run``, the processes exist and ``Accelerator()`` joins them at once.
    """
    return ENV_SETTINGS["devices"] in os.environ and "LOCAL_RANK" in os.environ


def apply_cli_settings(**args: Any) -> dict[str, Any]:
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
        if isinstance(out[name], (str, int)):
            if _same(name, out[name], DEFAULTS[name]):
                out[name] = parsed
            elif not _same(name, out[name], parsed):
                warnings.warn(
                    f"`minifabric run` set {name}={parsed!r} but the script passes Accelerator({name}={out[name]!r});"
                    " the script's value is used.",
                    stacklevel=3,
                )
    return out


def _same(name: str, a: Any, b: Any) -> bool:
    """Whether two spellings mean the same value (``"DDP"`` and ``"ddp"``, ``32`` and ``"32-true"``)."""
    if name in CHOICES:
        try:
            return canonical(name, a, warn=False) == canonical(name, b, warn=False)
        except ValueError:
            pass
    return a == b


#: the canonical values of each string argument
CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "accelerator": ACCELERATORS,
    "strategy": STRATEGIES,
    "precision": PRECISIONS,
})
_EXAMPLES = MappingProxyType({"accelerator": '"cpu"', "strategy": '"ddp"', "precision": '"bf16-mixed"'})


def canonical(name: str, value: Any, *, warn: bool = True) -> str:
    """The canonical spelling of an ``accelerator``, ``strategy`` or ``precision`` value.

    Case does not matter and Lightning Fabric's aliases are accepted with Fabric's meaning (with a
    one-line warning where Fabric warns). Anything else raises, suggesting the closest valid value.

    Args:
        name: ``"accelerator"``, ``"strategy"`` or ``"precision"``.
        value: what the user passed (``precision`` may also be the int 16, 32 or 64).
        warn: whether to show the note an alias carries.

    Raises:
        ValueError: ``value`` is no spelling of a valid choice.

    Example:
        >>> canonical("strategy", "FSDP")
        'fsdp'
        >>> canonical("precision", 32)
        '32-true'
    """
    choices = CHOICES[name]
    key = value
    if name == "precision" and isinstance(value, int) and not isinstance(value, bool):
        key = str(value)
    if isinstance(key, str):
        key = key.strip().lower()
        if key in choices:
            return key
        if key in ALIASES[name]:
            canonical_value, note = ALIASES[name][key]
            if note is not None and warn:
                warnings.warn(note, UserWarning, stacklevel=4)
            return canonical_value
    raise ValueError(_unknown_message(name, value, key))


def suggestion(name: str, value: Any) -> str | None:
    """The closest valid spelling of ``value`` for ``name`` (or what to use instead), or None.

    Example:
        >>> suggestion("strategy", "fdsp")
        '"fsdp"'
    """
    if not isinstance(value, str):
        return None
    key = value.strip().lower()
    if key in _HINTS[name]:
        return _HINTS[name][key]
    close = difflib.get_close_matches(key, [*CHOICES[name], *ALIASES[name]], n=1, cutoff=0.6)
    return f'"{ALIASES[name].get(close[0], (close[0],))[0]}"' if close else None


def _unknown_message(name: str, value: Any, key: Any) -> str:
    hint = suggestion(name, key)
    did_you_mean = f" Did you mean {name}={hint}?" if hint else ""
    return (
        f"Unknown {name}={value!r}.{did_you_mean} Choose one of {', '.join(map(repr, CHOICES[name]))},"
        f" e.g. Accelerator({name}={_EXAMPLES[name]})."
    )


def _accelerator_type(accelerator: str) -> str:
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
    environment: ClusterEnvironment | None = None,
) -> Resolved:
    """Validate the arguments and build environment, device, precision plugin and strategy.

    ``environment`` (from ``plugins=``) replaces the detected cluster environment.
    """
    device_type = _accelerator_type(canonical("accelerator", accelerator))
    precision = canonical("precision", precision)
    strategy_options: dict[str, Any] = {}
    spawn_only = False
    if not isinstance(strategy, Strategy):
        if isinstance(strategy, str) and strategy.strip().lower() == "ddp_find_unused_parameters_true":
            strategy_options["find_unused_parameters"] = True
        spawn_only = isinstance(strategy, str) and strategy.strip().lower() == "ddp_spawn"
        strategy = canonical("strategy", strategy)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive int, e.g. Accelerator(num_nodes=2).")
    indices = _device_indices(devices, device_type)
    env: ClusterEnvironment | LocalEnvironment = (
        environment if environment is not None else detect_cluster_environment()
    )
    if isinstance(env, LocalEnvironment) and env.creates_processes_externally:
        env.set_world_size(int(os.environ.get("WORLD_SIZE", 1)))

    if env.creates_processes_externally:
        num_processes = local_world_size(env, num_nodes)
        expected = len(indices) if indices is not None else devices
        if isinstance(expected, int) and expected * num_nodes != env.world_size():
            raise ValueError(
                f"{type(env).__name__} started {env.world_size()} processes, but"
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

    local_rank = env.local_rank()
    if device_type == "cuda":
        index = indices[local_rank] if indices is not None else local_rank
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")

    # processes started by an engine: the world is what it started (a Kubeflow pod or a torchrun node
    # may hold one process of many, whatever num_nodes says)
    world_size = env.world_size() if env.creates_processes_externally else num_processes * num_nodes
    if precision == "16-mixed" and device_type == "cpu":
        warnings.warn(_FP16_ON_CPU, UserWarning, stacklevel=3)
    precision_plugin = precision_from_string(precision, device_type)
    strategy_obj = (
        strategy
        if isinstance(strategy, Strategy)
        else strategy_from_string(strategy, world_size, **strategy_options)
    )
    strategy_obj.spawn_only = spawn_only or strategy_obj.spawn_only  # or DDPStrategy(start_method="spawn")
    strategy_obj.connect(
        environment=env,
        device=device,
        num_processes=num_processes,
        num_nodes=num_nodes,
        precision=precision_plugin,
    )
    return Resolved(env, device, num_processes, num_nodes, precision_plugin, strategy_obj)


def strategy_from_string(name: str, world_size: int, **options: Any) -> Strategy:
    """Build the strategy for a canonical strategy string (``options`` go to ``DDPStrategy``)."""
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
        return DDPStrategy(**options)
    if name == "fsdp":
        return FSDPStrategy()
    return FSDPStrategy(cpu_offload=True)
