"""Data loading: a resumable distributed sampler and the loader rebuild done by ``setup_dataloaders``."""

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
    """A ``DistributedSampler`` that can start its next pass at a given index (mid-epoch resume)."""

    start_index: int = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start_index = self.start_index, 0
        indices = list(super().__iter__())
        return iter(indices[start:])


def _resumable_sampler_wrapper(sampler: Any, num_replicas: int, rank: int, seed: int) -> DistributedSampler:
    """Lightning's ``DistributedSamplerWrapper`` over ``sampler`` (each rank gets its share of what the
    sampler yields, as in Fabric), able to start its next pass at a given index."""
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper

    class ResumableSamplerWrapper(DistributedSamplerWrapper):
        start_index: int = 0

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
