"""Meta-device init on one GPU against eager construction on the GPU (``init_module(empty_init=False)``).

On CUDA, eager construction draws from the device's generator; ``init_module(empty_init=True)`` records
on the device and replays there, so both give the same weights and buffers, bitwise, and leave the CPU
and CUDA generators in the same states, under every strategy (one GPU) and with the self-check on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.gpu.common import CUDA_MARKS, mismatches
from tests.helpers import run_distributed

pytestmark = CUDA_MARKS

STRATEGIES = ["single", "ddp", "fsdp", "fsdp_cpu_offload", "model_parallel"]
FAMILIES = ["nanogpt", "hf", "reset", "vit", "llama"]


def _build(family: str) -> Callable[[], nn.Module]:
    from tests import hf_tiny
    from tests.init_styles import STYLES

    return STYLES[family] if family in STYLES else lambda: hf_tiny.build(family)


def _strategy(name: str):
    from minifabric import ModelParallelStrategy

    if name == "model_parallel":
        return ModelParallelStrategy(lambda model, mesh: model, data_parallel_size=1, tensor_parallel_size=1)
    return name


def _streams() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.get_rng_state(), torch.cuda.get_rng_state()


def _meta_against_eager_on_device(rank: int, strategy: str, families: list[str], verify: bool) -> dict:
    acc = Accelerator(accelerator="cuda", strategy=_strategy(strategy), devices=1)
    acc.launch()
    out = {}
    for family in families:
        build = _build(family)
        torch.manual_seed(0)
        with acc.init_module(empty_init=False):
            eager = build()  # on the device, with the device's generator
        eager_streams = _streams()
        eager_devices = sorted({t.device.type for t in (*eager.parameters(), *eager.buffers())})
        torch.manual_seed(0)
        with acc.init_module(empty_init=True, verify=verify):
            model = build()
        meta_streams = _streams()
        model = acc.setup(model)
        out[family] = {
            "mismatches": mismatches(eager, model),
            "eager_devices": eager_devices,
            "cpu_stream_equal": torch.equal(eager_streams[0], meta_streams[0]),
            "cuda_stream_equal": torch.equal(eager_streams[1], meta_streams[1]),
            "cuda_stream_moved": not torch.equal(eager_streams[1], _seeded_cuda_stream()),
        }
    return out


def _seeded_cuda_stream() -> torch.Tensor:
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(0)
        return torch.cuda.get_rng_state()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_meta_init_on_cuda_equals_eager_construction_on_cuda(strategy: str) -> None:
    pytest.importorskip("transformers")
    (result,) = run_distributed(_meta_against_eager_on_device, 1, strategy, FAMILIES, False, timeout=300)
    for family, found in result.items():
        assert found["eager_devices"] == ["cuda"], family
        assert found["mismatches"] == [], family
        assert found["cuda_stream_moved"], f"{family}: the eager build drew nothing from the CUDA generator"
        assert found["cuda_stream_equal"], (
            f"{family}: the CUDA generator is not where eager construction leaves it"
        )
        assert found["cpu_stream_equal"], (
            f"{family}: the CPU generator is not where eager construction leaves it"
        )


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_the_self_check_on_cuda_compares_with_eager_construction_on_cuda(strategy: str) -> None:
    (result,) = run_distributed(
        _meta_against_eager_on_device, 1, strategy, ["nanogpt", "hf"], True, timeout=240
    )
    for family, found in result.items():
        assert found["mismatches"] == [], family
        assert found["cuda_stream_equal"] and found["cpu_stream_equal"], family


def _placement(rank: int, strategy: str) -> dict:
    from tests.init_styles import NanoGPTStyle

    acc = Accelerator(accelerator="cuda", strategy=strategy, devices=1)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = NanoGPTStyle()
    from minifabric.init.attach import handle_of

    with acc.init_module(empty_init=True):
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))  # one draw each: kept
    kept = {handle_of(p).base.kept[1].device.type for p in plain.parameters() if handle_of(p).base.kept}
    inner = acc.setup(model).module
    local = [getattr(p, "_local_tensor", p) for p in inner.parameters()]
    return {
        "param_devices": sorted({t.device.type for t in local}),
        "buffer_devices": sorted({b.device.type for b in inner.buffers()}),
        "kept_devices": sorted(kept),  # where the parts kept at construction waited for setup
    }


@pytest.mark.parametrize("strategy", ["single", "fsdp", "fsdp_cpu_offload"])
def test_meta_init_on_cuda_puts_parameters_and_buffers_where_eager_setup_does(strategy: str) -> None:
    (result,) = run_distributed(_placement, 1, strategy, timeout=240)
    assert result["param_devices"] == (["cpu"] if strategy == "fsdp_cpu_offload" else ["cuda"])
    assert result["buffer_devices"] == ["cuda"]
    assert result["kept_devices"] == result["param_devices"]  # offloaded: no part of the model on the GPU before setup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_each_rank_keeps_its_rows_of_the_dense_draw_on_cuda(parts: int, dtype: torch.dtype) -> None:
    """Every rank of an FSDP world of ``parts`` keeps exactly its rows of eager construction on the GPU."""
    from tests.init_styles import kept_parts_against_dense

    assert kept_parts_against_dense("cuda", parts, dtype) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_each_rank_draws_its_rows_of_large_layers_alone_and_they_equal_the_dense_draw(
    parts: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers of many rounds: each rank draws only the rounds that hold its rows (counted), and keeps
    exactly its rows of eager construction on the GPU; the generator ends where eager leaves it."""
    from minifabric.init import draws
    from tests.init_styles import kept_parts_against_dense

    partial, draw_part = [], draws.draw_part

    def counted(*args, **kwargs):
        part = draw_part(*args, **kwargs)
        partial.append(part is not None)
        return part

    monkeypatch.setattr(draws, "draw_part", counted)
    assert kept_parts_against_dense("cuda", parts, dtype, large=True) == []
    assert sum(partial) == 2 * parts  # the large weight and the large embedding, on every rank


FILLS = {
    "normal_": (torch.ops.aten.normal_.default, (0.0, 0.02)),
    "uniform_": (torch.ops.aten.uniform_.default, (-0.1, 0.1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fill", list(FILLS))
def test_the_partial_draw_self_test_holds_on_this_gpu(fill: str, dtype: torch.dtype) -> None:
    """On this GPU and torch, ATen's fills follow the round arithmetic (else meta init draws whole
    tensors: exact, slower; the card should know)."""
    from minifabric._torch.philox import replay_is_exact

    assert replay_is_exact(torch.device("cuda", torch.cuda.current_device()), FILLS[fill][0], dtype)


@pytest.mark.parametrize("shape", [(4099, 2048), (32000, 2048), (3, 1_000_003)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", list(FILLS))
def test_every_ranks_rows_drawn_alone_equal_the_dense_draw(
    fill: str, dtype: torch.dtype, shape: tuple
) -> None:
    """At 2, 3 and 8 ranks, every rank: its rows drawn alone equal its rows of the dense draw on the
    device's default generator, which ends where the dense draw leaves it."""
    from minifabric._torch.philox import draw_part
    from minifabric.init.draws import rows_of

    func, args = FILLS[fill]
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.cuda.default_generators[device.index]
    torch.cuda.manual_seed(11)
    dense = func(torch.empty(shape, dtype=dtype, device=device), *args)
    after = gen.get_offset()
    row, wrong = math.prod(shape[1:]), []
    for parts in (2, 3, 8):
        for rank in range(parts):
            lo, hi = rows_of(shape[0], parts, rank)
            torch.cuda.manual_seed(11)
            part = draw_part((func, args, {}), math.prod(shape), dtype, device, lo * row, hi * row)
            if part is None or not torch.equal(part, dense[lo:hi].flatten()) or gen.get_offset() != after:
                wrong.append(f"{parts} ranks, rank {rank}")
    assert wrong == []


def test_a_tensor_over_2_gib_gives_each_rank_its_rows_of_the_dense_draw_or_is_drawn_whole() -> None:
    """ATen fills a tensor of more than ``2**31 - 1`` bytes (fewer than ``2**31`` elements) in
    32-bit-indexable pieces, each from an offset of its own, where the round arithmetic does not hold:
    no rank may get rows (or a generator offset) other than the dense draw's."""
    from minifabric._torch.philox import draw_part
    from minifabric.init.draws import rows_of

    func, args = FILLS["normal_"]
    shape = (2**29 // 4096 + 1, 4096)  # float32: 2 GiB + 16 KiB
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.cuda.default_generators[device.index]
    torch.cuda.manual_seed(11)
    dense = func(torch.empty(shape, device=device), *args)
    after, wrong = gen.get_offset(), []
    for rank in range(2):
        lo, hi = rows_of(shape[0], 2, rank)
        torch.cuda.manual_seed(11)
        part = draw_part((func, args, {}), math.prod(shape), torch.float32, device, lo * 4096, hi * 4096)
        if part is not None and not (torch.equal(part, dense[lo:hi].flatten()) and gen.get_offset() == after):
            wrong.append(f"rank {rank}")
    del dense
    assert wrong == []
