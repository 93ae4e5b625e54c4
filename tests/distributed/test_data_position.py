"""A data loader's position saved mid-epoch and resumed on another number of ranks.

Each sample is its own id. A run on N ranks reads some batches of an epoch, saves
``{"loader": loader}``, and a run on M ranks loads it and reads the rest of the epoch. Over the
epoch, the ids seen by all ranks of both runs are exactly the dataset: every id at least once, and
no id twice except the padding a ``DistributedSampler`` adds to deal the rest evenly (fewer than M).
On the same number of ranks the resumed run reads, rank by rank, exactly what an uninterrupted one
reads.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from minifabric import Accelerator, CheckpointError
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SIZE = 23  # prime: no world size divides it, so every resume deals an uneven rest
BATCH = 2


def _loader(acc: Accelerator) -> DataLoader:
    acc.seed_everything(7)
    data = TensorDataset(torch.arange(SIZE))
    return acc.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))


def _read(rank: int, path: str, batches: int, load: bool) -> list[int]:
    """Read ``batches`` batches (all that is left if -1), loading the position first if ``load``; save it."""
    acc = Accelerator(accelerator="cpu", strategy="ddp")
    acc.launch()
    loader = _loader(acc)
    if load:
        acc.load(path, {"loader": loader})
    seen: list[int] = []
    for i, (ids,) in enumerate(loader):
        seen += ids.tolist()
        if i + 1 == batches:
            break
    if not load:
        acc.save(path, {"loader": loader})
    return seen


def _split_run(tmp_path, before: int, after: int, batches: int) -> tuple[list[list[int]], list[list[int]]]:
    path = str(tmp_path / "position")
    first = run_distributed(_read, before, path, batches, False)
    second = run_distributed(_read, after, path, -1, True)
    return first, second


@pytest.mark.parametrize(("before", "after", "batches"), [(2, 3, 3), (4, 2, 1), (3, 3, 2), (1, 2, 4)])
def test_the_epoch_is_the_dataset_exactly_whatever_the_ranks_on_resume(tmp_path, before, after, batches):
    first, second = _split_run(tmp_path, before, after, batches)
    counts = Counter(i for ids in [*first, *second] for i in ids)
    assert set(counts) == set(range(SIZE))  # none skipped
    consumed = before * batches * BATCH
    padding = (-(SIZE - consumed)) % after  # what the resumed pass adds to deal the rest evenly
    assert sum(counts.values()) - SIZE == padding < after  # none repeated beyond that padding
    assert len({len(ids) for ids in second}) == 1  # every resumed rank reads as many samples


def test_the_same_world_size_resumes_exactly_where_it_stopped(tmp_path):
    first, second = _split_run(tmp_path, 3, 3, 2)
    whole = run_distributed(_read, 3, str(tmp_path / "whole"), -1, False)
    assert [a + b for a, b in zip(first, second, strict=True)] == whole  # rank by rank, in order


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_an_iterable_dataset_is_refused_at_save_with_the_reason(tmp_path):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    loader = acc.setup_dataloaders(DataLoader(_Stream(), batch_size=2))
    next(iter(loader))
    with pytest.raises(CheckpointError, match=r"IterableDataset \(_Stream\).*cannot resume it"):
        acc.save(str(tmp_path / "ckpt.pt"), {"loader": loader})
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_loader_with_another_seed_is_refused_at_load(tmp_path):
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    loader = _loader(acc)
    next(iter(loader))
    acc.save(str(tmp_path / "ckpt.pt"), {"loader": loader})
    acc.seed_everything(8)
    other = acc.setup_dataloaders(
        DataLoader(TensorDataset(torch.arange(SIZE)), batch_size=BATCH, shuffle=True)
    )
    with pytest.raises(ValueError, match=r"saved with seed=7 but this loader has seed=8"):
        acc.load(str(tmp_path / "ckpt.pt"), {"loader": other})
