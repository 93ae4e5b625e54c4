"""Where the recorder creates an uninitialized tensor (minifabric.init.record): where eager construction would.

Inside ``init_module(empty_init=True)`` an empty factory whose tensor eager construction would create
on the build device (the strategy's) returns a tracked meta tensor, replayed there at ``setup``;
one it would create elsewhere (a CPU tensor in a CUDA block) is created for real, as in eager
construction, so its random init draws from the CPU's generator there too. The build device here is
an accelerator by name only: these calls allocate nothing on it (CUDA is not needed).
"""

from __future__ import annotations

import pytest
import torch

from minifabric.init import meta_init_context
from minifabric.init.attach import handle_of
from minifabric.init.generators import same_device
from minifabric.init.record import Recorder

ACCELERATOR = torch.device("cuda:0")


def test_empty_like_and_new_empty_follow_their_input_as_in_eager_construction() -> None:
    on_cpu = torch.zeros(2, 3)
    recorder = Recorder(device=ACCELERATOR)
    with torch.device(ACCELERATOR), recorder:
        like = torch.empty_like(on_cpu)
        new = on_cpu.new_empty(4)
        explicit = torch.empty(3, device="cpu")
        built_here = torch.empty(3)
        from_built = built_here.new_empty(5)
    for t in (like, new, explicit):  # eager: CPU tensors, drawing from the CPU's generator
        assert t.device.type == "cpu" and recorder.lookup(t) is None
    for t in (built_here, from_built):  # eager: on the build device; here recorded for it
        handle = recorder.lookup(t)
        assert t.is_meta and handle is not None and handle.base.device == ACCELERATOR


def test_another_index_of_the_build_devices_type_is_another_device() -> None:
    assert same_device(torch.device("cuda:1"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda:0"), torch.device("cuda:1"))
    assert not same_device(torch.device("cpu"), torch.device("cuda:0"))
    assert same_device(torch.device("cpu"), torch.device("cpu", 0))


def test_an_empty_factory_given_out_writes_that_tensor_as_in_eager_construction() -> None:
    out = torch.zeros(2)
    with meta_init_context():
        result = torch.empty(3, out=out)
    assert result is out and out.shape == (3,) and handle_of(out) is None


@pytest.mark.parametrize("build", [lambda t: torch.empty_like(t), lambda t: t.new_empty(4)])
def test_an_integer_tensor_like_a_real_one_is_real_as_in_eager_construction(build) -> None:
    indices = torch.arange(3)
    with meta_init_context():
        made = build(indices)
    assert not made.is_meta and made.dtype == torch.int64 and handle_of(made) is None


def test_the_block_builds_on_its_build_device_without_an_outer_device_context() -> None:
    """Called directly (not from ``init_module``), the block still builds where its recorder replays."""
    with meta_init_context(device=ACCELERATOR):
        built = torch.empty(3)
        assert torch.get_default_device() == ACCELERATOR
    handle = handle_of(built)
    assert built.is_meta and handle is not None and handle.base.device == ACCELERATOR
    assert torch.get_default_device() == torch.device("cpu")
