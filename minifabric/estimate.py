"""Will it fit? The per-rank peak memory of a training step, without allocating the model.

The model is built under torch's ``FakeTensorMode`` (tensors with shapes but no data) and set up by
the strategy itself: ``FSDPStrategy.setup_module`` (or ``ModelParallelStrategy.setup_module``) runs
on a fake process group of ``world_size`` ranks, with the precision's dtypes and mixed-precision
policy and activation checkpointing, so each rank holds exactly the local shards of the DTensors
that ``fully_shard`` (and the plan) leave on it. Then a training step runs under torch's memory
tracker (``FSDPMemTracker`` for sharded models; optimizer state created beforehand). The tracker
sees every tensor the step creates, so activations, gradients of activations and the
all-gather/reduce-scatter buffers come from the real forward and backward, not from a formula.

Fake execution costs time per operation, not per byte. A model with many identical blocks is
traced with 3 and with 4 of them, and every category is extended linearly to the real number of
blocks (what each additional block adds is the same for every block).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from types import MappingProxyType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from minifabric._torch import fake_tensor_mode, fake_world, memory_tracker, swapping_module_params
from minifabric.estimate_args import Factory, model_factory, parse_bytes, resolve_parallelize_fn
from minifabric.parameters import optimizer_parameters
from minifabric.precision import Precision, precision_from_string
from minifabric.runtime.environment import LocalEnvironment
from minifabric.strategies.fsdp import FSDPStrategy
from minifabric.strategies.fsdp_wrap import apply_activation_checkpointing, repeated_block_classes
from minifabric.strategies.model_parallel import ModelParallelStrategy
from minifabric.strategies.strategy import Strategy

StrategyName = Literal["single", "ddp", "fsdp", "model_parallel"]
OptimizerName = Literal["adamw", "adam", "sgd"]
OPTIMIZERS: Mapping[str, Callable[..., torch.optim.Optimizer]] = MappingProxyType({
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
})
STRATEGIES = ("single", "ddp", "fsdp", "model_parallel")
GiB = 2**30

# the tracker's tensor kinds (plain and FSDP) -> the categories we report
_CATEGORIES = MappingProxyType({
    "parameters": ("Parameter", "Buffer", "Sharded Param", "Unsharded Param"),
    "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer_state": ("Optstate", "OptState"),
    "activations": ("Activation", "Temp", "Inputs", "Other"),
    "communication": ("All Gather", "Reduce Scatter"),
})
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
    """Bytes per tensor kind at the peak of a fake training step of the model as its strategy sets it up."""
    precision = precision_from_string(run["precision"], "cpu")
    sharded = run["strategy"] in ("fsdp", "model_parallel")
    mode = fake_tensor_mode(allow_real_inputs=run["strategy"] == "model_parallel")
    with fake_world(run["world_size"]) if sharded else nullcontext():
        model, forward_context = _set_up(
            lambda: _kept(factory(keep_blocks), keep_blocks), precision, run, mode
        )
        with mode:
            optimizer = OPTIMIZERS[run["optimizer"]](model.parameters(), lr=1e-3)
            inputs = _fake_input(run["batch_shape"], run["input_dtype"])
            _create_state(optimizer)
            tracker = memory_tracker(model, optimizer, sharded)
            with tracker:  # one step: the peak is in backward or in the optimizer step
                with forward_context():
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


def _set_up(
    build: Callable[[], nn.Module], precision: Precision, run: dict[str, Any], mode: Any
) -> tuple[nn.Module, Callable[[], AbstractContextManager]]:
    """The model on fake tensors, set up by the run's strategy itself; and the context forward runs in.

    ``"fsdp"`` goes through ``FSDPStrategy.setup_module`` and ``"model_parallel"`` through
    ``ModelParallelStrategy.parallelize`` (its ``setup_module`` without materializing) on the fake
    world, so what each rank holds is what ``fully_shard`` and the plan leave on it: the local
    shards of the resulting DTensors.
    """
    checkpointing = run["activation_checkpointing"]
    if run["strategy"] == "model_parallel":
        # FSDP2 builds a new DeviceMesh for a tensor-parallel parameter, and a mesh finds its ranks
        # with a data-dependent op (`nonzero`) that FakeTensorMode refuses: lay the model out on the
        # meta device (no memory), then give each local shard fake storage of its shape.
        with torch.device("meta"), precision.tensor_init_context():
            model = build()
        two_d = ModelParallelStrategy(
            run["parallelize_fn"],
            data_parallel_size=run["world_size"] // run["tensor_parallel_size"],
            tensor_parallel_size=run["tensor_parallel_size"],
            activation_checkpointing_policy=_checkpointed(model, checkpointing),
        )
        _connect(two_d, run, precision)
        model = two_d.parallelize(model)  # setup_module's layout step (materializing is what it skips)
        with mode, swapping_module_params():
            model.to_empty(device="cpu")
        return model, two_d.forward_context
    with mode, precision.tensor_init_context():
        model = build().train()
    if run["strategy"] == "fsdp":
        fsdp = FSDPStrategy(activation_checkpointing_policy=_checkpointed(model, checkpointing))
        _connect(fsdp, run, precision)
        fsdp.mesh  # noqa: B018  (built here, outside fake mode: a DeviceMesh holds real index tensors)
        with mode:
            return fsdp.setup_module(model), fsdp.forward_context
    with mode:
        model = precision.convert_module(model)
        apply_activation_checkpointing(model, _checkpointed(model, checkpointing))
    return model, precision.forward_context


def _checkpointed(model: nn.Module, checkpointing: bool) -> set[type[nn.Module]]:
    """The classes whose activations are recomputed: the repeated blocks, with activation checkpointing."""
    return repeated_block_classes(model) if checkpointing else set()


def _connect(strategy: Strategy, run: dict[str, Any], precision: Precision) -> None:
    """Connect ``strategy`` as an Accelerator would: rank 0 of ``world_size`` processes on one node."""
    environment = LocalEnvironment()
    environment.set_world_size(run["world_size"])
    strategy.connect(
        environment=environment,
        device=torch.device("cpu"),
        num_processes=run["world_size"],
        num_nodes=1,
        precision=precision,
    )


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
