"""Data loading: a resumable distributed sampler and the loader rebuild done by ``setup_dataloaders``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from lightning_fabric.utilities.data import _update_dataloader, has_iterable_dataset
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start its next pass at a given index (mid-epoch resume)."""

    start_index: int = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start_index = self.start_index, 0
        indices = list(super().__iter__())
        return iter(indices[start:])


def distributed_dataloader(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """Rebuild ``dataloader`` with a sampler that gives this rank its own part of every epoch.

    Shuffling is kept if the original sampler shuffled; the order depends only on ``seed`` and the
    epoch, so every rank agrees on it and a resumed run sees the same order. The loader gets its own
    generator, so creating an iterator never draws from the global RNG.
    """
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
