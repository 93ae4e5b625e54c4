"""Saving a checkpoint, stage by stage: prepare -> collect -> write -> commit.

Each stage is one call that every rank makes and that ends in an agreement
(:meth:`Job.agreed`): an exception on any rank makes every rank raise the same
:class:`CheckpointError`, the staging folder is removed, and the previous checkpoint at ``path``
stays as it was. The service (``service.py``) calls them in order; an asynchronous save copies the
collected state to CPU before it returns, and agrees, writes and commits on a background thread.

- ``prepare``: local checks without collectives: the target (rank 0 creates the staging folder),
  every value ``load`` must read back, the stateful objects' states and this rank's RNG states.
- ``collect``: the state dicts (collective under FSDP with a full checkpoint), the metadata, and
  the split of the tree into the side record and the tensors DCP writes.
- ``write``: every rank writes its shard (or rank 0 the one file, durably).
- ``commit``: rank 0 writes the side record and commits (``commit.py``); then ``keep_last``.
"""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from minifabric.checkpoint import commit as commits
from minifabric.checkpoint import durable, periodic, rng
from minifabric.checkpoint.comm import Comm
from minifabric.checkpoint.errors import CheckpointError, UnsaveableValueError
from minifabric.checkpoint.format import FORMAT_KEY, FORMAT_VERSION, SIDE_RECORD, kinds
from minifabric.checkpoint.names import parameter_names, to_names
from minifabric.checkpoint.tensors import gather_full, split
from minifabric.checkpoint.ties import tied_groups
from minifabric.checkpoint.writer import ShardWriter

Filter = dict[str, Callable[[str, Any], bool]]


def check_filter(filter: Filter | None, state: dict[str, Any]) -> None:
    """Validate ``save(..., filter=)`` as Lightning Fabric does, before anything happens.

    Raises:
        TypeError: ``filter`` is not a dict, or one of its values is not callable.
        ValueError: a key of ``filter`` is not a key of ``state``.
    """
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise TypeError(
            f"filter= must be a dict of entry names to callables `(key, value) -> bool`, got {filter!r}."
        )
    if unknown := set(filter) - set(state):
        raise ValueError(f"The filter keys {unknown} are not present in the state keys {set(state)}.")
    for key, fn in filter.items():
        if not callable(fn):
            raise TypeError(f"filter[{key!r}] must be a callable `(key, value) -> bool`, got {fn!r}.")


def _filtered(key: str, tree: Any, filter: Filter) -> Any:
    """The items of state dict ``tree`` that ``filter[key]`` keeps (all when it has no filter)."""
    if key not in filter or not isinstance(tree, dict):
        return tree
    return {k: v for k, v in tree.items() if filter[key](k, v)}


@dataclass
class Job:
    """One save in progress: where it goes, in which format, and its staging folder (rank 0)."""

    comm: Comm
    path: Path
    form: str
    kinds: dict[str, str]
    keep_last: int | None = None
    filter: Filter = field(default_factory=dict)
    staging: commits.Staging | None = None
    work: Path | None = None  # the staging folder, on every rank (sharded)

    def agreed(self, shared: dict[str, Any] | None = None) -> AbstractContextManager[None]:
        """The agreement that ends each stage; a failure removes the staging folder first."""
        return self.comm.agreed(
            f"Saving the checkpoint {str(self.path)!r} failed",
            "; the previous checkpoint at that path is intact.",
            on_failure=self._abort,
            shared=shared,
        )

    def _abort(self) -> None:
        if self.staging is not None:
            commits.abort(self.staging)
        self.comm.barrier()  # every rank raises once the staging folder is gone


@dataclass
class Payload:
    """What ``write`` and ``commit`` write: the tensors for DCP (sharded) and the record (rank 0)."""

    tensors: dict[str, torch.Tensor] | None
    record: dict[str, Any] | None
    pending: tuple[BaseException | None, Any] = (
        None,
        None,
    )  # a collect error to agree on, this rank's record


def prepare(
    comm: Comm, path: Path, state: dict[str, Any], form: str, keep_last: int | None, filter: Filter
) -> tuple[Job, Any]:
    """Stage 1: check the target and the values, take the stateful states and the RNG (no collectives).

    Returns the job and this rank's record (``{"rng": ..., "stateful": {...}}``).
    """
    job = Job(comm, path, form, kinds(state), keep_last, filter)
    record = None
    shared: dict[str, Any] = {}
    with job.agreed(shared):
        if comm.is_zero:
            job.staging = _prepare_target(path, form)
            shared["value"] = str(job.staging.work) if job.staging is not None else None
        stateful = {
            k: _filtered(k, state[k].state_dict(), filter)
            for k, kind in job.kinds.items()
            if kind == "stateful"
        }
        values = {f"state[{k!r}]": v for k, v in state.items() if job.kinds[k] == "value"}
        values.update({f"state[{k!r}].state_dict()": v for k, v in stateful.items()})
        refuse_unloadable(values)
        record = {"rng": rng.capture(), "stateful": stateful}
    work = shared["all"][0]  # rank 0's staging folder
    job.work = Path(work) if work is not None else None
    return job, record


def _prepare_target(path: Path, form: str) -> commits.Staging | None:
    """Check ``path``; for a sharded checkpoint create its staging folder (rank 0).

    Waits first for the previous commit's clean-up, so that at most one older version is on the disk
    while this save writes.
    """
    commits.wait_for_cleanup()
    if form == "full":
        if message := writable_file_error(path):
            raise CheckpointError(message)
        return None
    if message := commits.target_error(path):
        raise CheckpointError(message)
    try:
        return commits.make_staging(path)
    except OSError as err:
        raise CheckpointError(f"Cannot create a staging folder for {str(path)!r}: {err}") from err


def writable_file_error(path: Path) -> str | None:
    """Why a one-file checkpoint cannot be written at ``path``, or None."""
    if path.is_dir():
        return (
            f"Cannot save a one-file checkpoint to {str(path)!r}: it is a directory. Choose a file path,"
            f" e.g. {str(path / 'checkpoint.pt')!r}, or save a sharded checkpoint."
        )
    return commits.unwritable_parent_error(path)


def collect(job: Job, state: dict[str, Any], record: Any, *, agree: bool = True) -> Payload:
    """Stage 2: the state dicts and the metadata (collective under FSDP with a full checkpoint).

    The agreement that ends it also gathers every rank's record into the metadata. With
    ``agree=False`` (a background save) it is left to :func:`agree_collected`, which the background
    thread runs together with the agreement on its CPU copy: the call returns after one collective.
    """
    comm = job.comm
    payload = Payload(None, None, pending=(None, record))
    try:
        full = job.form == "full"
        collected = _state_dicts(state, record["stateful"], full, comm.rank, comm.world_size, job.filter)
        meta = {
            "version": FORMAT_VERSION,
            "format": job.form,
            "world_size": comm.world_size,
            "kinds": job.kinds,
            "tied": {k: tied_groups(v) for k, v in state.items() if job.kinds[k] == "module"},
            "ranks": None,  # every rank's record, gathered by the agreement
        }
        tree, tensors = (collected, None) if full else _split_entries(collected, job.kinds)
        payload = Payload(
            tensors, {FORMAT_KEY: meta, "state": tree} if comm.is_zero else None, (None, record)
        )
    except BaseException as err:  # raised on every rank by the agreement
        payload.pending = (err, record)
    if agree:
        agree_collected(job, payload)
    return payload


def agree_collected(job: Job, payload: Payload) -> Payload:
    """End stage 2 (and, for a background save, its CPU copy): agree, and gather the ranks' records.

    An error kept in ``payload.pending`` (collecting or copying failed on this rank) is raised on
    every rank. Returns the payload to write.
    """
    error, record = payload.pending
    shared: dict[str, Any] = {"value": record}
    with job.agreed(shared):
        if error is not None:
            raise error
    if payload.record is not None:
        payload.record[FORMAT_KEY]["ranks"] = shared["all"]
    return payload


def write(job: Job, payload: Payload) -> None:
    """Stage 3: every rank writes its shard into the staging folder (DCP); or rank 0 the one file."""
    comm = job.comm
    with job.agreed():
        if job.form == "sharded":
            commits.fault("before_shard", comm.rank)
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=".*assuming the intent is to save in a single process.*"
                )
                writer = ShardWriter(job.work)  # type: ignore[arg-type]  # set by prepare
                dcp.save(
                    payload.tensors,
                    storage_writer=writer,
                    process_group=comm.group,
                    no_dist=not comm.distributed,
                )
            commits.fault("after_shard", comm.rank)
        elif comm.is_zero:
            job.path.parent.mkdir(parents=True, exist_ok=True)
            with durable.replacing(job.path) as f:
                torch.save(payload.record, f)
            commits.remove_stale(job.path)  # what an interrupted save left next to it


def commit(job: Job, payload: Payload) -> None:
    """Stage 4: rank 0 writes the side record and commits the sharded checkpoint; then ``keep_last``."""
    with job.agreed():
        if job.staging is not None:
            with durable.replacing(job.staging.work / SIDE_RECORD) as f:
                torch.save(payload.record, f)
            commits.commit(job.staging, job.comm.world_size)
    if job.keep_last is not None and job.comm.is_zero:  # only now that the new one is committed
        try:
            periodic.retain(job.path, job.keep_last)
        except OSError as err:  # the save itself succeeded
            warnings.warn(f"Removing older checkpoints next to {str(job.path)!r} failed: {err}", stacklevel=2)


def _state_dicts(
    state: dict[str, Any], stateful: dict[str, Any], full: bool, rank: int, world_size: int, filter: Filter
) -> dict[str, Any]:
    """The saveable form of ``state``: module and optimizer state dicts, values as they are.

    For a ``full`` checkpoint every DTensor is gathered, one at a time, into a full CPU tensor kept
    on rank 0 only; otherwise DTensors stay as they are (each rank writes its shard). Optimizer
    state is keyed by parameter name where the module it updates is in ``state``. ``stateful``
    holds the state dicts of the other stateful objects, already taken.
    """
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            tree = value.state_dict()
        elif isinstance(value, Optimizer):
            names = parameter_names(value, modules)
            state_dict = _optimizer_state_dict(value, rank, world_size)
            tree = to_names(state_dict, names) if names is not None else state_dict
        elif key in stateful:
            tree = stateful[key]
        else:
            tree = _filtered(key, value, filter)
        if isinstance(value, (nn.Module, Optimizer)):
            tree = _filtered(key, tree, filter)
        out[key] = gather_full(tree, keep=rank == 0) if full and key not in stateful else tree
    return out


def _optimizer_state_dict(optimizer: Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    """``optimizer.state_dict()``; torch's ``ZeroRedundancyOptimizer`` gathers its shards to rank 0 first."""
    if world_size > 1 and callable(getattr(optimizer, "consolidate_state_dict", None)):
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # collective: every rank sends its shard
        return optimizer.state_dict() if rank == 0 else {}
    return optimizer.state_dict()


def _split_entries(
    collected: dict[str, Any], entry_kinds: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Module and optimizer tensors, and DTensors anywhere, go to DCP (by reference); the rest stays in the record.

    A DTensor among plain values (e.g. ``acc.save(path, model.state_dict())`` under FSDP) is thus
    saved whole, each rank writing its shard, instead of rank 0's shard alone.
    """
    tree: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, value in collected.items():
        everything = entry_kinds[key] in ("module", "optimizer")
        tree[key], _ = split(key, value, only_dtensors=not everything, into=tensors)
    return tree, tensors


_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Tensor,
)
_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset)


def refuse_unloadable(values: dict[str, Any]) -> None:
    """Refuse a value that ``load`` could not read back, before anything is written.

    ``values`` maps how to name each value in a message (``"state['args']"``) to the value.
    Checkpoints are read with ``torch.load(weights_only=True)``, which admits tensors, Python
    primitives and containers of them, and no other class.

    Raises:
        UnsaveableValueError: naming the first such value (``state['args']``) and the fix.
    """
    for where, value in values.items():
        for place, leaf in _leaves(where, value):
            if not isinstance(leaf, _PLAIN) and not _reads_back(leaf):
                raise UnsaveableValueError(
                    f"{place} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which `load` could not"
                    " read back (checkpoints are read with `torch.load(weights_only=True)`, which admits"
                    f" tensors and plain Python values only). Nothing was written. Fix: {_fix(leaf)},"
                    " e.g. `state['args'] = vars(args)`."
                )


def _leaves(where: str, value: Any) -> Iterator[tuple[str, Any]]:
    """Every key and leaf of nested plain containers, with where it sits."""
    if type(value) not in _CONTAINERS:
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(f"{where}[{k!r}]", k)
            yield from _leaves(f"{where}[{k!r}]", v)
    else:
        for i, v in enumerate(value):
            yield from _leaves(f"{where}[{i}]", v)


def _reads_back(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back (tried in memory)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _fix(value: Any) -> str:
    name = type(value).__name__
    if name == "Namespace":
        return "`vars(args)` turns an argparse.Namespace into a dict"
    if callable(value):
        return "store its name or settings instead of the function or object itself"
    return (
        "convert it to plain values (a dict of numbers, strings, lists and tensors, e.g."
        " `dataclasses.asdict(x)`), or give its class `state_dict()` and `load_state_dict()`"
    )
