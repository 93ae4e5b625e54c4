"""Will it fit? The per-rank peak memory of a training step, without allocating the model.

The model is built under torch's ``FakeTensorMode`` (tensors with shapes but no data), set up the
way the strategy sets it up (``fully_shard`` per block then root on a fake process group of
``world_size`` ranks, the precision's dtypes and mixed-precision policy, activation checkpointing),
and a training step runs under torch's memory tracker (optimizer state created beforehand) (``FSDPMemTracker`` for FSDP). The tracker
sees every tensor the step creates, so activations, gradients of activations and the
all-gather/reduce-scatter buffers come from the real forward and backward, not from a formula.

Fake execution costs time per operation, not per byte. A model with many identical blocks is
traced with 3 and with 4 of them, and every category is extended linearly to the real number of
blocks (what each additional block adds is the same for every block).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from minifabric._torch import fake_tensor_mode, fake_world, memory_tracker
from minifabric.estimate_tp import give_fake_storage, resolve_parallelize_fn, sharded_meta_model
from minifabric.parameters import optimizer_parameters
from minifabric.precision import precision_from_string
from minifabric.strategies.fsdp_wrap import (
    ShardSettings,
    apply_activation_checkpointing,
    build_mesh,
    mixed_precision_policy,
    repeated_block_classes,
    select_blocks,
    shard_model,
)

StrategyName = Literal["single", "ddp", "fsdp", "model_parallel"]
OptimizerName = Literal["adamw", "adam", "sgd"]
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
STRATEGIES = ("single", "ddp", "fsdp", "model_parallel")
GiB = 2**30

# the tracker's tensor kinds (plain and FSDP) -> the categories we report
_CATEGORIES = {
    "parameters": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
    "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer_state": ("Optstate", "OptState"),
    "activations": ("Activation", "Temp", "Inputs", "Other"),
    "communication": ("All Gather", "Reduce Scatter"),
}
_SHARDED = ("Sharded Param", "Sharded Grad", "Optstate", "OptState")  # per rank: 1/world_size


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The estimated per-rank peak of a training step, in bytes, split by what holds the memory.

    ``largest_world_size_not_fitting`` is set when a ``budget`` was given: the largest number of
    ranks at which this configuration still exceeds the budget per device (``None`` if it fits at
    ``world_size`` or at 1 rank; ``-1`` if no number of ranks helps, e.g. DDP, or activations alone
    exceed the budget). ``suggestion`` says what to change.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    strategy: str
    world_size: int
    sharded: int = 0  # the part of the total that shrinks as 1/world_size (FSDP)
    budget: int | None = None
    largest_world_size_not_fitting: int | None = None
    suggestion: str = ""

    @property
    def total(self) -> int:
        """The per-rank peak in bytes."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.communication

    def at_world_size(self, world_size: int) -> int:
        """The per-rank peak at another number of ranks (FSDP: the sharded part scales as 1/N)."""
        return self.total - self.sharded + math.ceil(self.sharded * self.world_size / world_size)

    def __str__(self) -> str:
        rows = [(f.name.replace("_", " "), getattr(self, f.name)) for f in dataclasses.fields(self)[:5]]
        lines = [f"per-rank peak, {self.strategy} x {self.world_size}:"]
        lines += [f"  {name:16s} {value / GiB:9.2f} GiB" for name, value in rows]
        lines.append(f"  {'total':16s} {self.total / GiB:9.2f} GiB")
        if self.budget is not None:
            lines.append(f"  budget {self.budget / GiB:.2f} GiB per device: {self.suggestion}")
        return "\n".join(lines)


def estimate_memory(
    model: str | Callable[..., nn.Module] | Any,
    *,
    model_kwargs: dict[str, Any] | None = None,
    strategy: StrategyName = "fsdp",
    world_size: int = 1,
    precision: str = "32-true",
    optimizer: OptimizerName = "adamw",
    batch_shape: tuple[int, ...] = (1, 512),
    input_dtype: torch.dtype = torch.long,
    activation_checkpointing: bool = False,
    budget: int | str | None = None,
    tensor_parallel_size: int = 1,
    parallelize_fn: str | Callable[..., nn.Module] | None = None,
) -> MemoryEstimate:
    """Estimate the per-rank peak memory of training ``model`` (no real memory is allocated).

    Args:
        model: a factory (``make_model(**model_kwargs) -> nn.Module``), its import path
            ``"pkg.module:make_model"``, a Hugging Face config (``transformers.PretrainedConfig``) or
            the path of its ``config.json`` (needs ``transformers``; ``model_kwargs`` override fields).
        model_kwargs: keyword arguments for the factory, or config fields to override.
        strategy: ``"single"``, ``"ddp"``, ``"fsdp"`` (``FULL_SHARD``, each repeated block a unit) or
            ``"model_parallel"`` (``ModelParallelStrategy``: ``parallelize_fn`` on a
            ``(world_size / tensor_parallel_size, tensor_parallel_size)`` mesh, then FSDP over the
            data-parallel dimension).
        world_size: number of ranks.
        precision: an ``Accelerator`` precision string, e.g. ``"bf16-mixed"``.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (without momentum: no state).
        batch_shape: shape of one rank's input batch, e.g. ``(batch, sequence length)`` of token ids.
        input_dtype: dtype of the input (``torch.long`` for token ids; then the loss is next-token
            cross-entropy when the output has one more dimension than the input, else a mean).
        activation_checkpointing: recompute each repeated block's activations in backward.
        budget: bytes per device (int) or a string such as ``"80GiB"`` / ``"24GB"``.
        tensor_parallel_size: ranks per tensor-parallel group (``"model_parallel"`` only).
        parallelize_fn: the ``parallelize_fn(model, device_mesh)`` of ``ModelParallelStrategy``, or
            its import path ``"pkg.module:parallelize"`` (``"model_parallel"`` only).

    Returns:
        A :class:`MemoryEstimate` (``print`` it for a table).

    Example:
        >>> from minifabric import estimate_memory
        >>> est = estimate_memory("tests.models:GPT", strategy="single", batch_shape=(2, 16))
        >>> est.total > est.parameters > 0
        True
    """
    _check(strategy, world_size, optimizer, batch_shape)
    parallelize = resolve_parallelize_fn(strategy, world_size, tensor_parallel_size, parallelize_fn)
    precision_from_string(precision, "cpu")  # raises on an unknown precision string
    factory = model_factory(model, model_kwargs or {})
    budget_bytes = parse_bytes(budget) if budget is not None else None
    run = dict(
        strategy=strategy,
        world_size=world_size,
        precision=precision,
        optimizer=optimizer,
        batch_shape=tuple(batch_shape),
        input_dtype=input_dtype,
        activation_checkpointing=activation_checkpointing,
        tensor_parallel_size=tensor_parallel_size,
        parallelize_fn=parallelize,
    )
    estimate = _extrapolated(factory, run)
    if budget_bytes is None:
        return estimate
    fsdp = (
        estimate
        if strategy == "fsdp" and world_size > 1
        else _extrapolated(factory, {**run, "strategy": "fsdp", "world_size": max(2, world_size)})
    )
    largest, suggestion = _advice(estimate, fsdp, budget_bytes, activation_checkpointing)
    return dataclasses.replace(
        estimate, budget=budget_bytes, largest_world_size_not_fitting=largest, suggestion=suggestion
    )


def _check(strategy: Any, world_size: Any, optimizer: Any, batch_shape: Any) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy={strategy!r}: choose one of {STRATEGIES}, e.g. strategy='fsdp'.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}, e.g. world_size=8.")
    if strategy == "single" and world_size != 1:
        raise ValueError(
            f"strategy='single' runs on one rank, got world_size={world_size}: use strategy='ddp'."
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer={optimizer!r}: choose one of {tuple(OPTIMIZERS)}.")
    if not batch_shape or not all(isinstance(n, int) and n > 0 for n in batch_shape):
        raise ValueError(
            f"batch_shape must be positive ints, got {batch_shape!r}, e.g. batch_shape=(8, 2048)."
        )


def parse_bytes(value: int | str) -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80GB"`` (decimal), ``"512MiB"`` -> bytes."""
    if isinstance(value, int) and value > 0:
        return value
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    try:
        parsed = int(float(number) * units[text[len(number) :]])
    except (ValueError, KeyError):
        parsed = 0
    if parsed <= 0:
        raise ValueError(f"budget={value!r} is not a size: pass bytes or a string like '80GiB' or '24GB'.")
    return parsed


#: builds the model; given a number of blocks, it may build only that many (a config's layer count)
Factory = Callable[[int | None], nn.Module]


def model_factory(model: Any, kwargs: dict[str, Any]) -> Factory:
    """A function that builds the model, from any of the forms ``estimate_memory`` takes."""
    if isinstance(model, str) and not Path(model).exists():
        module_name, sep, attr = model.partition(":")
        if not sep:
            raise ValueError(
                f"model={model!r} is neither a file nor an import path: pass 'pkg.module:make_model' or the"
                " path of a Hugging Face config.json."
            )
        target = getattr(importlib.import_module(module_name), attr)
        return lambda _: target(**kwargs)
    if isinstance(model, (str, Path)) or type(model).__name__.endswith("Config"):
        return _hf_factory(model, kwargs)
    if callable(model):
        return lambda _: model(**kwargs)
    raise TypeError(f"model must be a factory, an import path or a Hugging Face config, got {model!r}.")


def _hf_factory(config: Any, overrides: dict[str, Any]) -> Factory:
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        raise ImportError(
            f"Reading the Hugging Face config {config!r} needs transformers: pip install transformers"
        ) from None
    if not hasattr(config, "to_dict"):
        config = AutoConfig.from_pretrained(str(config))
    for key, value in overrides.items():
        setattr(config, key, value)

    def build(blocks: int | None) -> nn.Module:
        cfg = copy.deepcopy(config)
        cfg.use_cache = False  # training keeps no key/value cache
        if blocks is not None and hasattr(cfg, "num_hidden_layers"):
            cfg.num_hidden_layers = blocks  # building 3 layers of 80 is what takes the time
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            return AutoModel.from_config(cfg)

    return build


# ---- tracing -----------------------------------------------------------------------------------


def _extrapolated(factory: Factory, run: dict[str, Any]) -> MemoryEstimate:
    """Trace the model, or (many identical blocks) 2 and 3 of its blocks and extend linearly."""
    with torch.device("meta"):
        blocks = _block_list(factory(None))
    if blocks is None or len(blocks) <= 4:
        return _estimate(_trace(factory, run, None), run)
    # (with 2 blocks the peak can fall at another point of the step; from 3 on it is where it stays)
    three, four = _trace(factory, run, 3), _trace(factory, run, 4)
    extra = len(blocks) - 3
    return _estimate({k: max(0, three[k] + extra * (four[k] - three[k])) for k in three | four}, run)


def _block_list(model: nn.Module) -> nn.ModuleList | None:
    """The ``ModuleList`` of repeated blocks (the FSDP units), if the model has exactly one."""
    classes = tuple(repeated_block_classes(model))
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and all(isinstance(c, classes) for c in m)
    ]
    return lists[0] if classes and len(lists) == 1 else None


def _trace(factory: Factory, run: dict[str, Any], keep_blocks: int | None) -> dict[str, int]:
    """Bytes per tensor kind at the peak of two fake training steps."""
    precision = precision_from_string(run["precision"], "cpu")
    two_d = run["strategy"] == "model_parallel"
    fsdp = run["strategy"] == "fsdp" or two_d
    world = fake_world(run["world_size"]) if fsdp else nullcontext()
    with world:
        mesh = build_mesh("FULL_SHARD", "cpu", 1, run["world_size"]) if fsdp and not two_d else None
        meta = None
        if two_d:
            meta = sharded_meta_model(
                lambda: _kept(factory(keep_blocks), keep_blocks),
                run["parallelize_fn"],
                run["world_size"],
                run["tensor_parallel_size"],
                precision,
                run["activation_checkpointing"],
            )
        with fake_tensor_mode(allow_real_inputs=two_d):
            if meta is not None:
                model = meta
                give_fake_storage(model)
            else:
                with precision.tensor_init_context():
                    model = _kept(factory(keep_blocks), keep_blocks)
                model = precision.convert_module(model).train()
            if run["activation_checkpointing"] and meta is None:
                apply_activation_checkpointing(model, repeated_block_classes(model))
            if mesh is not None:
                policy = mixed_precision_policy(precision)
                shard_model(
                    model, select_blocks(model, None), ShardSettings(mesh, True, policy, _no_offload())
                )
            optimizer = OPTIMIZERS[run["optimizer"]](model.parameters(), lr=1e-3)
            context = nullcontext if fsdp and precision.is_mixed else precision.forward_context
            inputs = _fake_input(run["batch_shape"], run["input_dtype"])
            _create_state(optimizer)
            tracker = memory_tracker(model, optimizer, fsdp)
            with tracker:  # one step: the peak is in backward or in the optimizer step
                with context():
                    output = model(precision.convert_input(inputs))
                _loss(output, inputs).backward()
                optimizer.step()
                optimizer.zero_grad()
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    counts = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items() if k != "Total"}
    if run["strategy"] == "ddp" and run["world_size"] > 1:
        # DDP's reducer keeps one flat bucket buffer per gradient for the all-reduce
        counts["DDP buckets"] = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
    return counts


def _kept(model: nn.Module, keep_blocks: int | None) -> nn.Module:
    """``model`` with only its first ``keep_blocks`` repeated blocks (all if None)."""
    blocks = _block_list(model)
    if keep_blocks is not None and blocks is not None:
        del blocks[keep_blocks:]
    return model


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its state (as after a first step) without running the model."""
    params = optimizer_parameters(optimizer)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def _no_offload() -> Any:
    from torch.distributed.fsdp import OffloadPolicy

    return OffloadPolicy()


def _fake_input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _loss(output: Any, inputs: torch.Tensor) -> torch.Tensor:
    output = getattr(output, "logits", output)
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not inputs.dtype.is_floating_point and output.dim() == inputs.dim() + 1:
        logits = output.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs.reshape(-1))
    return output.float().mean()


def _estimate(counts: dict[str, int], run: dict[str, Any]) -> MemoryEstimate:
    parts = {name: sum(counts.get(kind, 0) for kind in kinds) for name, kinds in _CATEGORIES.items()}
    parts["communication"] += counts.get("DDP buckets", 0)
    sharded = (
        sum(counts.get(kind, 0) for kind in _SHARDED)
        if run["strategy"] != "single" and run["strategy"] != "ddp"
        else 0
    )
    return MemoryEstimate(
        parts["parameters"],
        parts["gradients"],
        parts["optimizer_state"],
        parts["activations"],
        parts["communication"],
        strategy=run["strategy"],
        world_size=run["world_size"],
        sharded=sharded,
    )


# ---- advice --------------------------------------------------------------------------------------


def _advice(
    estimate: MemoryEstimate, fsdp: MemoryEstimate, budget: int, checkpointing: bool
) -> tuple[int | None, str]:
    """(largest world size that does not fit, what to do)."""
    if estimate.total <= budget:
        return None, f"fits: {estimate.total / GiB:.2f} GiB of {budget / GiB:.2f} GiB per device."
    fixed = fsdp.total - fsdp.sharded  # what sharding cannot shrink
    remedy = "" if checkpointing else " or activation checkpointing"
    if fixed >= budget:
        return -1, (
            f"does not fit at any world size: {fixed / GiB:.2f} GiB per rank is not sharded (activations,"
            f" one gathered block, buffers). Use a smaller batch{remedy}."
        )
    needed = math.ceil(fsdp.sharded * fsdp.world_size / (budget - fixed))
    while fsdp.at_world_size(needed) > budget:
        needed += 1
    if estimate.strategy != "fsdp":
        return (
            -1,
            f"needs FULL_SHARD on >= {needed} ranks{remedy}; {estimate.strategy} holds everything on every rank.",
        )
    return needed - 1, f"needs FULL_SHARD on >= {needed} ranks{remedy}."
