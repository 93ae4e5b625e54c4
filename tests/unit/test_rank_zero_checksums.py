"""The per-tensor checksums setup compares to tell whether the ranks built the same model.

Two ranks that drew a random permutation (``torch.randperm`` as a buffer, a shuffled copy of fixed
values) hold the same multiset of values: a sum and a norm alone are equal, and each rank would
keep its own slice of a different model.
"""

from __future__ import annotations

import torch

from minifabric.strategies.rank_zero_init import _checksums


def test_checksums_tell_permuted_values_apart() -> None:
    a = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    b = torch.randperm(100, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(a, b)
    assert not torch.equal(_checksums([a]), _checksums([b]))
    w = torch.randn(4, 8)
    assert not torch.equal(_checksums([w]), _checksums([w.flip(0)]))
    assert not torch.equal(_checksums([w]), _checksums([w.t().contiguous()]))


def test_checksums_equal_for_equal_tensors() -> None:
    w = torch.randn(3, 5, dtype=torch.bfloat16)
    assert torch.equal(_checksums([w, torch.zeros(0)]), _checksums([w.clone(), torch.zeros(0)]))
