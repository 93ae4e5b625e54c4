"""Data loading: a resumable distributed sampler, the loader rebuild done by ``setup_dataloaders``, and
the loader it returns (:class:`_WrappedDataLoader`: batches moved to the device, a saveable position).

The position of a pass is *global*: the number of positions of the epoch's order that every rank
together has consumed. ``DistributedSampler`` gives rank ``r`` of ``N`` the positions ``r, r+N,
r+2N, ...`` of one order that depends only on the seed and the epoch, so after ``k`` samples per
rank the ranks have consumed exactly the first ``k * N`` positions, whatever ``N`` is. A pass
resumed at that position on ``M`` ranks deals out the rest of the same order over ``M`` ranks
(:meth:`ResumableDistributedSampler.resume`): over the epoch every sample is seen once (plus the
padding a ``DistributedSampler`` adds, ``< M`` samples), and on ``M == N`` the rest is exactly what
the uninterrupted pass would have given each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sized
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler


def move_data_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor (or object with a ``.to`` method) in a nested batch to ``device``.

    Transfers to an accelerator are non-blocking; objects whose ``.to`` returns None (an in-place
    ``.to``) are kept as they are.
    """

    def move(data: Any) -> Any:
        non_blocking = isinstance(data, torch.Tensor) and device.type not in ("cpu", "mps")
        moved = data.to(device, non_blocking=True) if non_blocking else data.to(device)
        return data if moved is None else moved

    return apply_to_collection(batch, dtype=(torch.Tensor, _Transferable), function=move)


class _Transferable:
    """Matches any object with a callable ``.to`` (``isinstance`` only)."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return callable(getattr(subclass, "to", None))


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose next pass can start at a global position (mid-epoch resume).

    Example:
        >>> sampler = ResumableDistributedSampler(range(10), num_replicas=3, rank=0, shuffle=False)
        >>> sampler.resume(4)  # 4 positions consumed, e.g. on 2 ranks: the rest is dealt over 3
        >>> list(sampler)
        [4, 7]
    """

    #: global positions of this epoch's order consumed before the next pass starts
    consumed: int = 0

    def resume(self, consumed: int) -> None:
        """Start the next pass after the first ``consumed`` positions of the epoch's order."""
        self.consumed = max(0, int(consumed))

    def _order(self) -> list[int]:
        """The epoch's order of the whole dataset (the same on every rank and for any world size)."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        return list(range(len(self.dataset)))  # type: ignore[arg-type]

    def _rest(self) -> list[int]:
        """The positions this pass deals out: the rest of the order, trimmed or padded to the ranks."""
        order = self._order()
        rest = order[min(self.consumed, len(order)) :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        else:
            padding = (-len(rest)) % self.num_replicas
            while padding > 0:  # as DistributedSampler pads: from the head of the order
                rest += order[:padding]
                padding -= min(padding, len(order))
        return rest

    def __iter__(self) -> Iterator[int]:
        if not self.consumed:
            return super().__iter__()
        rest = self._rest()
        self.consumed = 0
        return iter(rest[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        if not self.consumed:
            return super().__len__()
        return len(self._rest()) // self.num_replicas

    def position(self, consumed: int) -> dict[str, Any]:
        """The state of an epoch of which all ranks together have consumed ``consumed`` positions.

        Besides ``consumed`` it describes the order, so that :meth:`check_position` can refuse a
        loader that would continue a different one.
        """
        return {
            "consumed": consumed,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_size": len(self.dataset),  # type: ignore[arg-type]
        }

    def check_position(self, state: dict[str, Any]) -> None:
        """Refuse a saved position whose order differs from this sampler's (naming the value).

        Raises:
            ValueError: seed, shuffling, ``drop_last`` or the dataset size differ.
        """
        mine = self.position(0)
        for key in ("seed", "shuffle", "drop_last", "dataset_size"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"The dataloader's position was saved with {key}={state[key]!r} but this loader has"
                    f" {key}={mine[key]!r}: it would continue a different order and repeat or skip samples."
                    f" Build the loader as in the saved run (same dataset, shuffle, drop_last, and"
                    f" `acc.seed_everything(seed)` before `setup_dataloaders`)."
                )


def _resumable_sampler_wrapper(sampler: Any, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """Lightning's ``DistributedSamplerWrapper`` over ``sampler`` (each rank gets its share of what the
    sampler yields, as in Fabric), able to start its next pass at a given index."""
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

    class ResumableSamplerWrapper(DistributedSamplerWrapper):
        start_index: int = 0

        def resume(self, consumed: int) -> None:
            """Start the next pass after ``consumed`` positions (all ranks together; same world size)."""
            self.start_index = consumed // self.num_replicas

        def __iter__(self) -> Iterator[Any]:
            start, self.start_index = self.start_index, 0
            return iter(list(super().__iter__())[start:])

    return ResumableSamplerWrapper(sampler, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)


def setup_dataloader(
    dataloader: DataLoader, use_distributed_sampler: bool, num_replicas: int, rank: int, seed: int
) -> DataLoader:
    """The loader ``setup_dataloaders`` iterates: ``dataloader`` itself, or rebuilt with a distributed sampler.

    As in Fabric: a loader over an iterable dataset, with a ``DistributedSampler`` already, or with
    ``use_distributed_sampler=False`` is kept as built; so is one with a custom sampler on one
    process. With several processes a custom sampler is wrapped so that each rank gets its share of
    what it yields (it must have ``__len__``). A ``RandomSampler`` or ``SequentialSampler`` is
    replaced by a resumable ``DistributedSampler`` (also on one process, for mid-epoch resume).
    """
    from lightning_fabric.utilities.data import has_iterable_dataset

    if not use_distributed_sampler or has_iterable_dataset(dataloader):
        return dataloader
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler):
        return dataloader
    if isinstance(sampler, (RandomSampler, SequentialSampler)):  # as Fabric: over the dataset
        return distributed_dataloader(dataloader, num_replicas, rank, seed)
    if num_replicas == 1:
        return dataloader
    if not isinstance(sampler, Sized):
        raise TypeError(
            f"The DataLoader's sampler {type(sampler).__name__} has no `__len__`, so it cannot be split"
            " between the processes. Give it a `__len__`, or shard the data yourself and pass"
            " `acc.setup_dataloaders(loader, use_distributed_sampler=False)`."
        )
    from lightning_fabric.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, _resumable_sampler_wrapper(sampler, num_replicas, rank, seed))


def distributed_dataloader(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """Rebuild ``dataloader`` with a sampler that gives this rank its own part of every epoch.

    Shuffling is kept if the original sampler shuffled; the order depends only on ``seed`` and the
    epoch, so every rank agrees on it and a resumed run sees the same order. The loader gets its own
    generator, so creating an iterator never draws from the global RNG.
    """
    from lightning_fabric.utilities.data import _update_dataloader, has_iterable_dataset

    if has_iterable_dataset(dataloader):
        return dataloader
    shuffle = isinstance(dataloader.sampler, RandomSampler)
    sampler = ResumableDistributedSampler(
        dataloader.dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
    )
    loader = _update_dataloader(dataloader, sampler)
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(seed + rank)
        loader._minifabric_generator_seed = seed + rank  # type: ignore[attr-defined]
    return loader


def refuse_iterable_position(dataloader: DataLoader) -> None:
    """Raise when ``dataloader`` reads an ``IterableDataset``: its position cannot be saved.

    Raises:
        TypeError: naming the dataset and what to do instead.
    """
    from lightning_fabric.utilities.data import has_iterable_dataset

    if has_iterable_dataset(dataloader):
        raise TypeError(
            f"Cannot save the position of a DataLoader over an IterableDataset"
            f" ({type(dataloader.dataset).__name__}): the library does not choose which samples each rank"
            " reads, so it cannot resume it, nor on another number of ranks. Leave the loader out of the"
            ' saved state and save your dataset\'s own position instead (e.g. `"data": dataset.state_dict()`),'
            " or use a map-style Dataset."
        )


def owns_generator(loader: DataLoader) -> bool:
    """Whether minifabric created ``loader``'s generator (and so may re-seed it every epoch)."""
    return getattr(loader, "_minifabric_generator_seed", None) is not None and loader.generator is not None


def reseed_loader_generator(loader: DataLoader, epoch: int) -> bool:
    """Seed a minifabric-made loader generator from (seed, rank, epoch); False if the user owns it.

    Its state is then a function of the epoch alone, so a checkpoint need not store it and a
    resumed run (on any number of processes) draws the same worker seeds.
    """
    if not owns_generator(loader):
        return False
    base = loader._minifabric_generator_seed  # type: ignore[attr-defined]
    loader.generator.manual_seed((base * 1_000_003 + epoch) % (2**63))  # type: ignore[union-attr]
    return True


_END = object()  # what `next` returns when a pass has no batch left


class _WrappedDataLoader:
    """Moves batches to the device and sets the sampler's epoch at the start of every pass.

    ``state_dict()``/``load_state_dict()`` record the epoch and the samples already consumed, so a
    run restored from a checkpoint continues at the next unseen batch.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device | None) -> None:
        self._dataloader = dataloader
        self._device = device
        self._epoch = 0
        self._samples_seen = 0  # of this rank, in the current pass
        self._consumed_before = 0  # positions of the epoch consumed by all ranks before this pass
        self._start = 0  # positions consumed before the next iter() (set by load_state_dict)
        self._in_epoch = False
        self._follow = False  # loaded during a pass: the pass goes on from the loaded position
        self._generator_state: torch.Tensor | None = None
        self._iterated = False  # an iterator was created (persistent workers keep theirs)
        self._before_batch: list[Callable[[], None]] = []

    def call_before_each_batch(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` before every batch is drawn (and before the end of a pass is found).

        A hook may load a position into this loader (``load_state_dict``): the running pass then
        draws its next batch from there.
        """
        self._before_batch.append(hook)

    @property
    def dataloader(self) -> DataLoader:
        """The underlying ``DataLoader``."""
        return self._dataloader

    @property
    def device(self) -> torch.device | None:
        """Where batches are moved (None with ``move_to_device=False``), as Fabric's loader has it."""
        return self._device

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        while (yield from self._pass()):  # loaded during the pass: go on from the loaded position
            pass

    def _pass(self) -> Generator[Any, None, bool]:
        """One pass over the epoch from the loaded position; True if it stopped to follow a load."""
        self._follow = False
        sampler = getattr(self._dataloader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)
        consumed, self._start = self._start, 0
        if consumed and not hasattr(sampler, "resume"):
            raise RuntimeError(
                "This dataloader cannot resume mid-epoch: its sampler was not set up by minifabric."
                " Use `acc.setup_dataloaders(loader)` (with use_distributed_sampler=True)."
            )
        if consumed:
            sampler.resume(consumed)  # type: ignore[union-attr]
        self._consumed_before = consumed
        generator = getattr(self._dataloader, "generator", None)
        loader = self._dataloader
        reused = loader.persistent_workers and loader.num_workers > 0 and self._iterated
        if owns_generator(loader) and not consumed and not reused:
            # A loader without a generator of its own (Fabric's) draws its workers' base seed from
            # the global RNG when it creates an iterator (once with persistent workers): draw it
            # too, so the script's random stream stays Fabric's (a pass resumed mid-epoch made
            # that draw before the checkpoint).
            torch.empty((), dtype=torch.int64).random_()
            if getattr(sampler, "shuffle", False) and getattr(sampler, "num_replicas", 0) == 1:
                # on one process Fabric keeps the RandomSampler, which draws its own seed too
                torch.empty((), dtype=torch.int64).random_()
        self._iterated = True
        if not reseed_loader_generator(self._dataloader, self._epoch) and generator is not None:
            # Creating the iterator draws from the generator: keep the state from before that
            # draw, so a run resumed mid-epoch draws the same worker seeds again.
            self._generator_state = generator.get_state()
        batch_size = self._dataloader.batch_size or 1
        self._samples_seen, self._in_epoch = 0, True
        batches = iter(self._dataloader)
        while True:
            for hook in self._before_batch:
                hook()
            if self._follow:  # a hook loaded a position: draw from there instead
                return True
            batch = next(batches, _END)
            if batch is _END:
                break
            self._samples_seen += batch_size
            yield move_data_to_device(batch, self._device) if self._device is not None else batch
            if self._follow:
                return True
        self._epoch += 1
        self._samples_seen, self._in_epoch, self._consumed_before = 0, False, 0
        return False

    def state_dict(self) -> dict[str, Any]:
        """Where iteration resumes: the epoch and this rank's samples consumed in it.

        The state is the same on every rank when minifabric built the loader's generator (it is
        re-seeded from the epoch), so it also maps onto a different number of processes.
        """
        refuse_iterable_position(self._dataloader)
        sampler = getattr(self._dataloader, "sampler", None)
        replicas = getattr(sampler, "num_replicas", 1)
        consumed = self._consumed_before + self._samples_seen * replicas  # by all ranks together
        if self._start and not self._in_epoch:  # loaded, not iterated since
            consumed = self._start
        state: dict[str, Any] = {
            "epoch": self._epoch,
            "samples_seen": consumed // replicas,
            "num_replicas": replicas,
        }
        if isinstance(sampler, ResumableDistributedSampler):
            state.update(sampler.position(consumed))
        generator = getattr(self._dataloader, "generator", None)
        if generator is not None and not owns_generator(self._dataloader):
            state["generator"] = self._generator_state if self._in_epoch else generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the first sample not seen yet: at the next ``iter()``, or,
        when loaded while a pass runs, at that pass's next batch.

        The position is global (samples consumed by all ranks together), so a loader saved on N
        processes resumes on M: the rest of the epoch is dealt over the M ranks, and over the whole
        epoch every sample is seen once (see :mod:`minifabric.data`).

        Raises:
            ValueError: the saved order (seed, shuffle, ``drop_last``, dataset size) differs from this loader's.
        """
        sampler = getattr(self._dataloader, "sampler", None)
        if isinstance(sampler, ResumableDistributedSampler):
            sampler.check_position(state_dict)
        saved_replicas = int(state_dict.get("num_replicas", 1))
        consumed = int(state_dict.get("consumed", int(state_dict["samples_seen"]) * saved_replicas))
        replicas = getattr(sampler, "num_replicas", 1)
        if consumed and replicas != saved_replicas and not isinstance(sampler, ResumableDistributedSampler):
            raise ValueError(
                f"The dataloader was saved mid-epoch on {saved_replicas} processes and is loaded on"
                f" {replicas}, but its sampler ({type(sampler).__name__}) is your own: its position maps"
                " only onto the same number of processes. Resume on the same number, or at an epoch"
                " boundary (save after the epoch ends)."
            )
        self._epoch = int(state_dict["epoch"])
        self._start = consumed
        self._follow = self._in_epoch
        generator = getattr(self._dataloader, "generator", None)
        if generator is not None and "generator" in state_dict:
            generator.set_state(state_dict["generator"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dataloader, name)
