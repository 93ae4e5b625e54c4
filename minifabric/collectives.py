"""Collectives over the default process group; each is the identity with one process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from minifabric._torch import differentiable_all_gather, tree_map
from minifabric.errors import PeerFailed

_REDUCE_OPS = MappingProxyType({
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
})


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` is True on any rank (one all-reduce of a single CPU integer; use a gloo group)."""
    if _world_size() == 1:
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())


@contextmanager
def first_then_others(first: bool, any_rank: Callable[[bool], bool]) -> Iterator[None]:
    """The body runs on the rank with ``first`` set, then on the others (``rank_zero_first``).

    The others wait in ``any_rank`` (a collective every rank enters twice in all): the first rank
    enters it once its body is done, saying whether the body raised, so a failure there ends the
    waiting ranks with :class:`PeerFailed` instead of a hang.
    """
    if not first and any_rank(False):
        raise PeerFailed("rank 0 failed inside `acc.rank_zero_first()`; its traceback is above.")
    try:
        yield
    except BaseException:
        if first:
            any_rank(True)  # release the waiting ranks with the news
        raise
    if first:
        any_rank(False)


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Return rank ``src``'s picklable object on every rank (of ``group``, default: all)."""
    if _world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's picklable object, in rank order, on rank ``dst`` (None elsewhere)."""
    world = _world_size()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank."""
    world = _world_size()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _as_tensor(data: Any, device: torch.device) -> torch.Tensor:
    return data if isinstance(data, torch.Tensor) else torch.tensor(data, device=device)


def check_group(group: Any) -> None:
    """Refuse a ``group=`` that is not a process group this rank belongs to (torch would skip the call).

    Raises:
        TypeError: ``group`` is not a ``torch.distributed.ProcessGroup`` (nor None).
        ValueError: this rank is not a member of ``group``.
    """
    if group is None:
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what `new_group` returns on the ranks outside it
        raise ValueError(
            f"This rank ({dist.get_rank()}) is not in the group passed as group=: `new_group` returned"
            " GroupMember.NON_GROUP_MEMBER here. Call the collective only on the group's ranks:"
            " `if torch.distributed.get_rank(group) >= 0: acc.all_reduce(x, group=group)`."
        )
    if not isinstance(group, dist.ProcessGroup):
        hint = (
            ' The reduce op follows the group, as in Fabric: `acc.all_reduce(x, reduce_op="sum")`.'
            if isinstance(group, str)
            else ""
        )
        raise TypeError(
            f"group={group!r} is not a torch.distributed ProcessGroup. Pass None (all ranks) or a group,"
            f" e.g. `group = torch.distributed.new_group([0, 1])` on every rank, then `acc.all_gather(x, group=group)`.{hint}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"This rank ({dist.get_rank()}) is not in the group passed as group=, so torch would skip the"
            " collective and return the input unchanged. Call it only on the group's ranks:"
            " `if torch.distributed.get_rank(group) >= 0: acc.all_reduce(x, group=group)`."
        )


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _reduce_op_name(reduce_op: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a name or a ``torch.distributed.ReduceOp`` (as Fabric takes)."""
    if isinstance(reduce_op, str) and reduce_op in _REDUCE_OPS:
        return reduce_op
    by_op = {
        dist.ReduceOp.SUM: "sum",
        dist.ReduceOp.AVG: "mean",
        dist.ReduceOp.MAX: "max",
        dist.ReduceOp.MIN: "min",
    }
    if not isinstance(reduce_op, str):
        for op, name in by_op.items():
            if reduce_op == op:
                return name
    raise ValueError(
        f"Unknown reduce_op={reduce_op!r}. Choose one of {', '.join(map(repr, _REDUCE_OPS))}"
        " (or torch.distributed.ReduceOp.SUM, AVG, MAX, MIN)."
    )


def all_reduce(
    data: Any, reduce_op: Any, device: torch.device, group: dist.ProcessGroup | None = None
) -> Any:
    """Reduce every tensor (or number) in ``data`` over all ranks (or ``group``'s): ``"mean"``, ``"sum"``, ``"max"``, ``"min"``."""
    reduce_op = _reduce_op_name(reduce_op)
    check_group(group)
    world = _group_size(group)

    def reduce(value: Any) -> Any:
        if not isinstance(value, (torch.Tensor, int, float)):
            return value
        if not isinstance(value, torch.Tensor):  # a number: the result is a new tensor
            tensor = torch.tensor(value, device=device)
            if reduce_op == "mean" and not tensor.is_floating_point():
                tensor = tensor.double()
            return _reduce_in_place(tensor, reduce_op, world, device, group)
        if reduce_op == "mean" and not (value.is_floating_point() or value.is_complex()):
            raise TypeError(
                f'all_reduce(reduce_op="mean") writes the mean into the tensor in place, but this tensor is'
                f' {value.dtype}. Reduce a float copy: `acc.all_reduce(t.double())`, or use reduce_op="sum".'
            )
        return _reduce_in_place(value, reduce_op, world, device, group)

    return tree_map(reduce, data)


def _reduce_in_place(
    tensor: torch.Tensor, reduce_op: str, world: int, device: torch.device, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks of ``group`` into itself (as Fabric does) and return it.

    Outside autograd: reducing a loss before ``backward`` changes its value, not its gradients.
    """
    if world == 1:
        return tensor
    _check_same_layout(tensor, world, device, group, "all_reduce")
    with torch.no_grad():
        work = tensor.to(device).contiguous()  # the backend's device, e.g. a CPU tensor under NCCL
        dist.all_reduce(work, op=_REDUCE_OPS[reduce_op], group=group)
        if reduce_op == "mean":
            work.div_(world)
        if work is not tensor:
            tensor.copy_(work)
    return tensor


def _gathered(values: list[int], world: int, device: torch.device, group: Any) -> list[list[int]]:
    """Every rank's list of ints (the same length on every rank), in rank order."""
    mine = torch.tensor(values, dtype=torch.long, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def _dtype_names() -> list[str]:
    """Every torch dtype's name, sorted: the same list on every rank of one torch version."""
    return sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)})


def _all_equal(values: list[int], device: torch.device, group: Any) -> bool:
    """Whether every rank passed these ints: one all-reduce (MAX of the values and of their negatives)."""
    mine = torch.tensor(values, dtype=torch.long, device=device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(both[: len(values)], -both[len(values) :]))


def _shape_code(shape: torch.Size) -> int:
    """One int for a shape (equal shapes give equal codes; unequal ones differ but for a ~2**-61 chance)."""
    code = len(shape)
    for size in shape:
        code = (code * 1_000_003 + size + 1) % (2**61 - 1)
    return code


def _check_same_layout(tensor: torch.Tensor, world: int, device: torch.device, group: Any, op: str) -> None:
    """Raise on every rank unless every rank passes ``op`` a tensor of this shape and dtype.

    Gloo aborts the process on buffers of different sizes (and NCCL may hang, or reduce bytes that
    are not the same values), so the ranks first agree on one header of one size everywhere (rank
    count, dtype, element count, a code of the shape), with the op itself: one small collective
    when the ranks agree.
    Only when they do not are the shapes themselves gathered (padded to the largest rank count),
    for the message.
    """
    names = _dtype_names()
    header = [tensor.dim(), names.index(str(tensor.dtype)), tensor.numel(), _shape_code(tensor.shape)]
    if op == "all_reduce":  # agreement by the op itself (a hang report names the collective the user called)
        if _all_equal(header, device, group):
            return
        headers = _gathered(header, world, device, group)
    else:
        headers = _gathered(header, world, device, group)
        if all(h == headers[0] for h in headers):
            return
    longest = max(h[0] for h in headers)
    padded = (
        _gathered(list(tensor.shape) + [-1] * (longest - tensor.dim()), world, device, group)
        if longest
        else []
    )
    shapes = [tuple(p[: h[0]]) for p, h in zip(padded, headers, strict=True)] if longest else [()] * world
    if any(s != tuple(tensor.shape) for s in shapes):
        raise ValueError(
            f"{op} needs the same shape on every rank; this rank has {tuple(tensor.shape)}, the ranks"
            f" have {shapes}. Pad the tensors to one shape first (and gather the true lengths separately)."
        )
    dtypes = [names[h[1]] for h in headers]
    raise ValueError(
        f"{op} needs the same dtype on every rank; this rank has {tensor.dtype}, the ranks have"
        f" {dtypes}. Convert first, e.g. `acc.{op}(x.float())`."
    )


def all_gather(
    data: Any, device: torch.device, group: dist.ProcessGroup | None = None, sync_grads: bool = False
) -> Any:
    """Gather every tensor in ``data`` from all ranks (or ``group``'s), stacked along a new first dimension.

    With one process the tensors come back without a new dimension, as in Lightning Fabric. With
    ``sync_grads`` the result is part of the autograd graph (as Fabric's, through
    ``torch.distributed.nn.functional.all_gather``): the gradient each rank's slice receives on any
    rank is summed back into that rank's tensor.
    """
    check_group(group)
    world = _group_size(group)

    def gather(value: Any) -> Any:
        if not isinstance(value, (torch.Tensor, int, float)):
            return value
        tensor = _as_tensor(value, device).contiguous()
        if world == 1:  # as Fabric: no new dimension with one process
            return tensor
        _check_same_layout(tensor, world, device, group, "all_gather")
        if sync_grads:
            return torch.stack(differentiable_all_gather(tensor, group))
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor, group=group)
        return torch.stack(out)

    return tree_map(gather, data)
