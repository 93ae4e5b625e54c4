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
from torch import nn

from minifabric.init import materialize, meta_init_context
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
        assert t.device.type == "cpu" and recorder.tracked.lookup(t) is None
    for t in (built_here, from_built):  # eager: on the build device; here recorded for it
        handle = recorder.tracked.lookup(t)
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


def _cpu_parameter_built_in_an_accelerator_block(how: str) -> nn.Module:
    module = nn.Module()
    with meta_init_context(device=ACCELERATOR):
        if how == "created":
            module.p = nn.Parameter(torch.zeros(3, device="cpu"))
        else:  # `.data =`: eager construction leaves the parameter where that tensor is
            module.p = nn.Parameter(torch.empty(3))
            module.p.data = torch.zeros(3, device="cpu")
        nn.init.normal_(module.p)
    return module


@pytest.mark.parametrize("how", ["created", "data set"])
def test_a_cpu_parameter_draws_from_the_cpus_generator_in_an_accelerator_block(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager construction draws its init from the CPU's generator: so do the recording and the replay.

    The accelerator's generator is read (not drawn from) around each random call; without CUDA its
    state reads as a constant here.
    """
    constant = torch.zeros(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": constant)
    torch.manual_seed(0)
    expected = torch.zeros(3).normal_()
    torch.manual_seed(0)
    module = _cpu_parameter_built_in_an_accelerator_block(how)
    assert torch.equal(torch.get_rng_state(), _after(expected))
    assert handle_of(module.p).base.device == torch.device("cpu")
    materialize(module)
    assert torch.equal(module.p, expected)


def _after(drawn: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    torch.empty_like(drawn).normal_()
    return torch.get_rng_state()
