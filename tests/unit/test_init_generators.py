"""The random streams meta init records and replays (minifabric.init.generators), on the CPU.

The same functions serve a GPU build device (the CUDA tier checks that against eager construction on
the GPU: tests/gpu/test_cuda_init.py); here the build device is the CPU: one stream.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifabric.init import materialize, meta_init_context
from minifabric.init.attach import handle_of
from minifabric.init.generators import CPU, advanced, drawing_from, states


def test_advanced_names_only_the_streams_that_moved():
    before = states(CPU)
    assert before[1] is None  # the CPU has one stream
    assert advanced(before, CPU) == (None, None)
    torch.rand(3)
    moved, device_moved = advanced(before, CPU)
    assert moved is not None and torch.equal(moved, before[0]) and device_moved is None


def test_drawing_from_starts_at_the_state_and_restores_the_stream_after():
    torch.manual_seed(5)
    start = torch.get_rng_state()
    expected = torch.rand(4)
    torch.manual_seed(9)
    outside = torch.get_rng_state()
    with drawing_from(start, None, CPU):
        assert torch.equal(torch.rand(4), expected)
    assert torch.equal(torch.get_rng_state(), outside)
    with drawing_from(None, None, CPU):  # nothing recorded: the live stream, untouched
        torch.rand(1)
    assert not torch.equal(torch.get_rng_state(), outside)


def test_a_random_init_records_the_cpu_state_it_started_from_and_the_build_device():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with meta_init_context(device="cpu"):
        layer = nn.Linear(4, 4)
    handle = handle_of(layer.weight)
    assert handle is not None and handle.base.device == CPU
    (op,) = [op for op in handle.base.ops if op.draws]
    assert torch.equal(op.rng, before) and op.device_rng is None
    after_block = torch.get_rng_state()
    materialize(layer)
    assert torch.equal(torch.get_rng_state(), after_block)  # replay forks the stream
    torch.manual_seed(0)
    assert torch.equal(layer.weight, nn.Linear(4, 4).weight)


def test_an_explicit_generator_is_replayed_on_its_own_device():
    gen = torch.Generator().manual_seed(3)
    with meta_init_context():
        w = nn.Parameter(torch.empty(8))
        nn.init.normal_(w, generator=gen)
    (op,) = handle_of(w).base.ops
    assert op.generator_devices == {"generator": CPU}
    materialize_into = nn.Module()
    materialize_into.w = w
    materialize(materialize_into)
    assert torch.equal(materialize_into.w, torch.empty(8).normal_(generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_each_rank_keeps_its_rows_of_the_dense_draw(parts: int, dtype: torch.dtype) -> None:
    from tests.init_styles import kept_parts_against_dense

    assert kept_parts_against_dense("cpu", parts, dtype) == []


def test_kept_parts_wait_where_the_parameters_will_live():
    """A strategy that keeps parameters elsewhere (FSDP's CPU offload) gets its kept parts there."""
    with meta_init_context(keep=(2, 1), device="cpu", keep_on="meta"):
        layer = nn.Linear(4, 6)
    (parts, index), part = handle_of(layer.weight).base.kept
    assert (parts, index) == (2, 1) and part.is_meta and part.shape == (3, 4)
