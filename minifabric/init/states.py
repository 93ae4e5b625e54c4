"""The random draws and real values a recorded init reads: what ranks compare to agree on one model.

A script that seeds every rank differently before building the model (nanoGPT's
``torch.manual_seed(1337 + rank)``) records different generator states on each rank. Replayed as
they are, each rank would fill its shard from its own stream: a model whose rows come from several
seeds. :func:`init_inputs` lists what a model's recorded init reads that can differ between ranks
(the generator states of its random calls, the real tensors it read), :func:`digest` condenses them
for a cheap comparison, and :func:`adopt_inputs` replaces them with another rank's, so that
replaying gives that rank's construction. No communication here; strategies call these.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from minifabric._torch import tree_flatten
from minifabric.init.recipe import Base, Handle, Op, Real, Ref

#: What :func:`adopt_inputs` takes: per random op ``(CPU rng state, build device's rng state,
#: {generator kwarg: state})``, the real tensors in order, then per op the plain values of its
#: arguments (see :func:`_arguments`).
_States = tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]
Inputs = tuple[list[_States], list[torch.Tensor], list[str]]

_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype)  # not devices: cuda:0 vs cuda:1


def _arguments(op: Op) -> str:
    """The plain values an op was called with (numbers, strings, dtypes), other arguments by type.

    A number drawn from Python's ``random`` or numpy (``normal_(w, std=random.uniform(...))``) is
    recorded here, not in a generator state: ranks seeded differently differ only in it.
    """
    leaves = tree_flatten((op.args, op.kwargs))[0]
    return (
        f"{op.name}("
        + ", ".join(repr(x) if isinstance(x, _PLAIN) else type(x).__name__ for x in leaves)
        + ")"
    )


def _walk(handles: list[Handle]) -> tuple[list[Base], list[Op], list[torch.Tensor]]:
    """Every base reachable from ``handles`` (through the refs their ops read), its ops, the real tensors read."""
    bases: dict[int, Base] = {}
    ops: dict[int, Op] = {}
    reals: dict[int, torch.Tensor] = {}
    stack = list(handles)

    def read(values: Any) -> None:
        for leaf in tree_flatten(values)[0]:
            if isinstance(leaf, Ref):
                stack.append(leaf.handle)
            elif isinstance(leaf, Real):
                reals.setdefault(id(leaf.tensor), leaf.tensor)

    while stack:
        handle = stack.pop()
        for _, args, kwargs, _ in handle.chain:
            read((args, kwargs))
        base = handle.base
        if id(base) in bases:
            continue
        bases[id(base)] = base
        if base.value is not None:
            reals.setdefault(id(base.value), base.value)
        for op in ([base.creator] if base.creator is not None else []) + base.ops:
            if id(op) not in ops:
                ops[id(op)] = op
                read((op.args, op.kwargs))
    ordered_ops = sorted(ops.values(), key=lambda op: op.seq)
    return list(bases.values()), ordered_ops, list(reals.values())


def init_inputs(handles: list[Handle]) -> Inputs:
    """The generator states of the random calls the recorded init of ``handles`` makes, and the real
    tensors it reads, in recording order (the same order on every rank that ran the same code)."""
    _, ops, reals = _walk(handles)
    states = [(op.rng, op.device_rng, dict(op.generators)) for op in ops if op.draws]
    # CPU copies: sent to other ranks, a tensor on this rank's GPU would arrive on that GPU's index
    return states, [real.detach().cpu() for real in reals], [_arguments(op) for op in ops]


def digest(inputs: Inputs) -> str:
    """A short hash of ``inputs``: equal on two ranks exactly when their recorded init reads the same."""
    h = hashlib.blake2b(digest_size=16)
    states, reals, arguments = inputs
    h.update(f"{len(states)} {len(reals)}".encode())
    for call in arguments:
        h.update(call.encode() + b"\0")
    for rng, device_rng, generators in states:
        h.update(b"-" if rng is None else _bytes(rng))
        h.update(b"-" if device_rng is None else _bytes(device_rng))
        for name in sorted(generators):
            h.update(name.encode() + _bytes(generators[name]))
    for tensor in reals:
        h.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode() + _bytes(tensor))
    return h.hexdigest()


def _bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def adopt_inputs(handles: list[Handle], inputs: Inputs) -> None:
    """Make the recorded init of ``handles`` read ``inputs`` (another rank's :func:`init_inputs`).

    Values kept from this rank's construction are dropped (they came from this rank's draws), so
    materializing replays every tensor with the adopted states.

    Raises:
        ValueError: ``inputs`` does not fit this recording (the ranks built different models).
    """
    bases, ops, reals = _walk(handles)
    random_ops = [op for op in ops if op.draws]
    states, values, arguments = inputs
    fits = len(states) == len(random_ops) and len(values) == len(reals)
    fits = fits and all(
        set(generators) == set(op.generators)
        and (rng is None) == (op.rng is None)
        and (device_rng is None) == (op.device_rng is None)
        for (rng, device_rng, generators), op in zip(states, random_ops, strict=False)
    )
    fits = fits and all(
        v.shape == r.shape and v.dtype == r.dtype for v, r in zip(values, reals, strict=False)
    )
    if not fits:
        raise ValueError(
            f"This rank's model was built with other init calls than rank 0's ({len(random_ops)} random"
            f" calls and {len(reals)} real tensors read here, {len(states)} and {len(values)} on rank 0):"
            " every rank must run the same model code inside `acc.init_module(empty_init=True)`."
        )
    mine = [_arguments(op) for op in ops]
    if mine != arguments:
        here, there = next((m, a) for m, a in zip(mine, arguments, strict=True) if m != a)
        raise ValueError(
            f"This rank's model init was called with other argument values than rank 0's ({here} here,"
            f" {there} on rank 0), e.g. numbers drawn from Python's `random` or numpy after per-rank"
            " seeds; replaying rank 0's random draws with them would shard another model. Seed every"
            " rank alike before building the model and per rank after setup:"
            " `acc.seed_everything(1337); model = acc.setup(model); acc.seed_everything(1337 + acc.global_rank)`."
        )
    for (rng, device_rng, generators), op in zip(states, random_ops, strict=True):
        op.rng, op.device_rng, op.generators = rng, device_rng, dict(generators)
    with torch.no_grad():
        for value, real in zip(values, reals, strict=True):
            real.copy_(value)
    for base in bases:
        base.kept = None
