"""Private parts of ``torch.distributed``: FSDP2's policy, DTensor layouts, the default store, fake worlds,
and the autograd engine's end-of-backward callback that FSDP2 itself uses."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import nn


def at_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the backward pass running now ends, before ``backward()`` returns.

    The autograd engine's final callbacks, the mechanism FSDP2 uses to finish its own reduction:
    one queued from inside a backward hook runs after every gradient of that pass is computed and
    after the callbacks queued before it (FSDP2's own). Returns False, queueing nothing, when no
    backward pass is running.
    """
    from torch.autograd import Variable

    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass."
        return False
    return True


def differentiable_all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (of ``group``), in rank order, inside the autograd graph.

    On NCCL, ``torch.distributed.nn.functional.all_gather``, as Lightning Fabric's ``sync_grads=True``
    uses: its backward sums each slice's gradients from every rank with a reduce-scatter. torch marks
    it deprecated in favour of the functional collectives, whose backward needs a reduce-scatter that
    gloo lacks; its warning is silenced here, for this call only. Elsewhere (gloo) torch's backward
    scatters with group ranks taken as global ranks, which fails in a group without rank 0, so
    :class:`_GatherWithSummedGrads` sums the gradients with one all-reduce instead.
    """
    import warnings

    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) not in ("nccl", "xccl"):
        return list(_GatherWithSummedGrads.apply(group, tensor))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
        return list(all_gather(tensor, group=group))


class _GatherWithSummedGrads(torch.autograd.Function):
    """All-gather whose backward gives each rank the sum, over the group's ranks, of its slice's gradients."""

    @staticmethod
    def forward(ctx: Any, group: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's ``tensor`` of ``group``, in group rank order."""
        import torch.distributed as dist

        ctx.group = group
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, torch.Tensor]:
        """This rank's slice of the gradients summed over the group (one all-reduce)."""
        import torch.distributed as dist

        summed = torch.stack(grads).contiguous()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.group)
        return None, summed[dist.get_rank(ctx.group)]


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of storing them.

    Uses torch's composable ``checkpoint``, which works through forward hooks and so keeps the
    module's class and parameter names (optimizer rebinding and checkpoints match by name).
    """
    from torch.distributed._composable.checkpoint_activation import checkpoint

    checkpoint(module)


def activations_checkpointed(module: nn.Module) -> bool:
    """Whether torch's composable ``checkpoint`` was applied to ``module`` (applying it twice is an error).

    Read from torch's own registry of composable APIs on the module, which ``copy.deepcopy`` copies
    along with the hooks.
    """
    from torch.distributed._composable.contract import _get_registry

    return "checkpoint" in (_get_registry(module) or {})


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks in this one process (no communication).

    Collectives return at once with outputs of the right shape, so FSDP can be applied and run on
    fake tensors as rank 0 of ``world_size``. Process-wide: refused while a real group exists, and
    destroyed on exit.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "estimate_memory simulates the ranks with its own process group, but one is already"
            " initialized. Estimate before `acc.launch()`, or from the command line:"
            " `minifabric estimate pkg.module:make_model ...`."
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensor_mode(allow_real_inputs: bool = False) -> Any:
    """torch's ``FakeTensorMode``: tensors carry shape, dtype and device but no data.

    ``allow_real_inputs``: meta and real tensors made outside may enter (a model sharded on the
    meta device, the index tensors of a 2-D ``DeviceMesh``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_real_inputs)


def memory_tracker(module: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> Any:
    """torch's memory tracker over ``module`` and ``optimizer`` (``FSDPMemTracker`` for sharded ones).

    Used as a context manager around training steps; ``get_tracker_snapshot("peak")`` then gives, per
    device, the bytes of each kind of tensor at the peak.
    """
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(module, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    return tracker


def local_box(shape: Any, mesh: Any, placements: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's part of a tensor of ``shape`` under a DTensor layout: its shape and where it starts."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def local_slice(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's part of ``full`` under a DTensor layout, cut on ``full``'s own device (no comms)."""
    shape, offset = local_box(full.shape, mesh, placements)
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        full = full.narrow(dim, start, size)
    return full


def laid_out_like(full: torch.Tensor, like: Any) -> torch.Tensor:
    """``full`` laid out like ``like``: this rank's shard of it when ``like`` is a DTensor of that shape.

    Every rank holds ``full`` (read from the same file, or the same state before ``setup``), so
    each keeps its own slice without communication (``src_data_rank=None``).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor) and not isinstance(full, DTensor) and full.shape == like.shape:
        local = full.to(like.device_mesh.device_type)
        return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return full


def with_local(local: torch.Tensor, like: Any) -> Any:
    """A DTensor laid out like ``like`` whose shard is ``local`` itself, wherever ``local`` is (no comms).

    ``DTensor.from_local`` moves a shard to its mesh's device type: a host copy of a CUDA
    DTensor's shard would go back to the GPU. torch's own staging of state dicts
    (``torch.distributed._state_dict_utils``) swaps the shard of a DTensor alike.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def default_store() -> Any:
    """The key-value store of the default process group (shared by every rank of the run)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def group_timeout(group: Any = None) -> timedelta | None:
    """The collective timeout of ``group`` (default: the default process group), as it was created.

    None where this torch or backend does not expose it (a group made with it then gets torch's
    default timeout, as before).
    """
    from torch.distributed.distributed_c10d import _get_default_group

    pg = _get_default_group() if group is None else group
    try:
        return pg._get_backend(pg._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return None


def fsdp_policy(module: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` was given for ``module`` (an ``FSDPModule``)."""
    return module._get_fsdp_state()._mp_policy  # type: ignore[operator]


#: how torch's ``parallelize_module`` says that a plan key matched no submodule (a warning, not an error)
_UNRESOLVED_PLAN_KEY = "Parallelize plan key"


@contextmanager
def unresolved_plan_keys() -> Iterator[list[str]]:
    """Collect the messages of torch's "plan key could not be resolved" warnings raised inside.

    torch's ``parallelize_module`` skips a plan entry that names no submodule with only a warning,
    so a typo leaves that layer replicated. The caller turns these messages into an error; every
    other warning is re-emitted unchanged.
    """
    import warnings

    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield found
    for warning in caught:
        text = str(warning.message)
        if text.startswith(_UNRESOLVED_PLAN_KEY):
            found.append(text)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def load_pre_hooks_keep_nothing(module: nn.Module) -> bool:
    """Whether every load pre-hook of ``module`` is FSDP2's own, which reshards and ignores the tensors.

    FSDP2 registers one on each module holding its parameters. It is recognised by its code
    object, found in the code of the method that registers it; any other hook may keep the tensors
    it sees.
    """
    return all(
        getattr(getattr(hook, "hook", hook), "__code__", None) is _fsdp_to_sharded_hook_code()
        for hook in module._load_state_dict_pre_hooks.values()
    )


def load_post_hooks_are_fsdps(module: nn.Module) -> bool:
    """Whether every load post-hook of ``module`` is FSDP2's own (one per parameter, which re-pads its shard).

    Recognised by its code object, found in the code of ``FSDPParam.__init__``; any other hook may
    change the missing and unexpected keys ``load_state_dict`` reports.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    codes = [c for c in FSDPParam.__init__.__code__.co_consts if getattr(c, "co_name", None) == "<lambda>"]
    ours = codes[0] if len(codes) == 1 else object()  # not found: no hook is taken for FSDP's
    return all(
        getattr(getattr(hook, "hook", hook), "__code__", None) is ours
        for hook in module._load_state_dict_post_hooks.values()
    )


def _fsdp_to_sharded_hook_code() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    codes = [
        const
        for const in FSDPParamGroup._register_state_dict_hooks.__code__.co_consts
        if getattr(const, "co_name", None) == "to_sharded_hook"
    ]
    return codes[0] if len(codes) == 1 else object()  # not found: no hook is taken for FSDP's


def inside_distribute_module() -> bool:
    """Whether torch's ``distribute_module`` is running on the caller's stack (found by its code object).

    Every tensor-parallel style (``parallelize_module``) registers its DTensors from inside it,
    made with ``distribute_tensor`` from the parameter that was there: a re-layout, same values.
    """
    from torch.distributed.tensor import distribute_module

    code = distribute_module.__code__
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
