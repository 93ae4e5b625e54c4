"""Data loading: a resumable distributed sampler and the loader rebuild done by ``setup_dataloaders``.

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

from collections.abc import Iterator, Sized
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
