"""Drawing a rank's rows of a dense random fill alone (minifabric._torch.philox), on the CPU.

The round arithmetic is checked against an emulated counter-based generator laid out as ATen's CUDA
fills are (round ``k`` of a fill at offset ``o`` depends only on the seed and ``o + 4k``), and the
self-test is shown to refuse generators laid out otherwise. Which calls are one dense fill, and that
a fill's recorded arguments give the call's values, are checked with real calls. The recorder's use
of it is checked with the CPU's own full draw standing in for the device's partial one. On a GPU,
tests/gpu/test_cuda_init.py checks the real thing against the dense draw.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from minifabric._torch import philox, seeded_op_probe
from minifabric.init import materialize, meta_init_context
from minifabric.init.attach import handle_of
from minifabric.init.draws import rows_of

CPU = torch.device("cpu")


class Emulated:
    """A counter-based stream laid out as ATen's CUDA fills: ``size`` elements per round, ``step``
    offset units per round; round ``k`` of a fill started at offset ``o`` depends on ``o + step*k`` only."""

    def __init__(self, size: int, step: int = 4, seed: int = 7) -> None:
        self.size, self.step, self.seed, self.offset = size, step, seed, 0

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def fill(self, t: torch.Tensor) -> torch.Tensor:
        rounds = -(-t.numel() // self.size)
        values = [
            torch.rand(self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + self.step * k))
            for k in range(rounds)
        ]
        t.copy_(torch.cat(values)[: t.numel()].to(t.dtype))
        self.offset += self.step * rounds
        return t


@pytest.mark.parametrize("size", [1, 3, 64, 97])
def test_a_range_drawn_alone_equals_the_dense_draw_and_leaves_the_offset_where_it_does(size: int) -> None:
    rng = random.Random(size)
    for _ in range(60):
        numel = rng.randint(1, 9 * size + 5)
        start = rng.randint(0, numel)
        end = rng.randint(start, numel)
        gen = Emulated(size)
        gen.set_offset(4 * rng.randint(0, 50))
        origin = gen.get_offset()
        dense = gen.fill(torch.empty(numel))
        after = gen.get_offset()
        gen.set_offset(origin)
        part = philox.draw_range(gen.fill, gen, numel, start, end, size, torch.float32, CPU)
        assert torch.equal(part, dense[start:end]), (numel, start, end)
        assert gen.get_offset() == after == origin + 4 * math.ceil(numel / size)


@pytest.mark.parametrize("numel", [8, 16, 24, 9, 17, 23])
def test_ranges_on_and_next_to_round_boundaries_equal_the_dense_draw(numel: int) -> None:
    """Every range whose ends lie on a round boundary or one element off it (one-round tensors,
    tensors of whole rounds and of a partial last round; empty ranges at each boundary)."""
    size = 8
    points = sorted({min(max(k * size + d, 0), numel) for k in range(4) for d in (-1, 0, 1)})
    gen = Emulated(size)
    dense = gen.fill(torch.empty(numel))
    after = gen.get_offset()
    for start in points:
        for end in (p for p in points if p >= start):
            gen.set_offset(0)
            part = philox.draw_range(gen.fill, gen, numel, start, end, size, torch.float32, CPU)
            assert torch.equal(part, dense[start:end]) and gen.get_offset() == after, (start, end)


def test_a_range_whose_draw_raises_leaves_the_offset_where_it_was() -> None:
    """A draw that fails (out of memory for its rounds) moves the stream no more than the failed
    dense fill would: a caller that goes on draws what eager construction draws."""
    gen = Emulated(10)
    gen.set_offset(8)

    def failing(t: torch.Tensor) -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        philox.draw_range(failing, gen, 100, 45, 90, 10, torch.float32, CPU)
    assert gen.get_offset() == 8


def test_the_self_test_passes_where_the_arithmetic_holds() -> None:
    gen = Emulated(50)
    assert philox.check_replay(gen.fill, gen, 50, torch.float32, CPU)


@pytest.mark.parametrize(
    "emulated, assumed",
    [(Emulated(50), 48), (Emulated(48), 50), (Emulated(50, step=8), 50), (Emulated(50, step=2), 50)],
    ids=["rounds-larger", "rounds-smaller", "offset-steps-larger", "offset-steps-smaller"],
)
def test_the_self_test_refuses_a_generator_laid_out_otherwise(emulated: Emulated, assumed: int) -> None:
    assert not philox.check_replay(emulated.fill, emulated, assumed, torch.float32, CPU)


def test_no_partial_draw_off_cuda() -> None:
    fill = (torch.ops.aten.normal_.default, (), {})
    assert philox.draw_part(fill, 10**6, torch.float32, CPU, 0, 10) is None


ROUND = 1_081_344  # an H100's round of float32 fills


@pytest.mark.parametrize(
    "dtype, numel, alone",
    [
        (torch.float32, 2**29 + 1, False),  # 2 GiB + 4 bytes (the first size ATen splits): < 2**31 elements
        (torch.bfloat16, 2**30 + 1, False),
        (torch.float64, 2**28 + 1, False),
        (torch.float32, 496 * ROUND, True),  # 496 whole rounds: 2 GiB - 2 MiB
        (torch.bfloat16, 2 * 496 * ROUND, True),
    ],
    ids=["f32-over", "bf16-over", "f64-over", "f32-under", "bf16-under"],
)
def test_no_partial_draw_of_a_tensor_aten_fills_in_pieces(
    dtype: torch.dtype, numel: int, alone: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATen draws a fill over more than ``2**31 - 1`` bytes (not elements) as several fills, one per
    32-bit-indexable piece, each from an offset of its own (``distribution_nullary_kernel``): the
    round arithmetic does not hold there, so such a tensor is drawn whole."""
    drawn: list[tuple] = []
    monkeypatch.setattr(philox, "round_size", lambda device, dtype: ROUND)
    monkeypatch.setattr(philox, "replay_is_exact", lambda device, func, dtype: True)
    monkeypatch.setattr(philox, "draw_range", lambda *args: drawn.append(args) or torch.empty(0))
    monkeypatch.setattr(torch.cuda, "default_generators", (Emulated(ROUND),))
    fill = (torch.ops.aten.normal_.default, (), {})
    part = philox.draw_part(fill, numel, dtype, torch.device("cuda", 0), numel // 2, numel)
    assert (part is not None, len(drawn)) == ((True, 1) if alone else (False, 0))


def _fill_of(call, shape=(6, 5), dtype=torch.float32):
    target = torch.empty(shape, dtype=dtype, device="meta")
    with seeded_op_probe() as probe:
        call(target)
    return philox.dense_fill(probe.calls, target)


NORMAL, UNIFORM = torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default
DENSE_CALLS = {
    "Tensor.normal_": lambda w: w.normal_(0.5, 2.0),
    "nn.init.normal_": lambda w: nn.init.normal_(w, std=0.02),
    "nn.init.uniform_": lambda w: nn.init.uniform_(w, -3, 1),
    "kaiming_uniform_": lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
    "kaiming_normal_": lambda w: nn.init.kaiming_normal_(w, mode="fan_out"),
    "xavier_uniform_": lambda w: nn.init.xavier_uniform_(w, gain=1.3),
    "xavier_normal_": lambda w: nn.init.xavier_normal_(w),
}


@pytest.mark.parametrize("shape", [(6, 5), (4, 3, 2, 2)], ids=["2d", "conv"])
@pytest.mark.parametrize("name", list(DENSE_CALLS))
def test_a_dense_fills_arguments_give_the_calls_values(name: str, shape: tuple) -> None:
    """The fill the probe sees (an ATen op and its numbers), run on a flat tensor, gives the values the
    Python call gives (its bound or std computed from the real shape), in the same order."""
    call = DENSE_CALLS[name]
    fill = _fill_of(call, shape)
    assert fill is not None and fill[0] in (NORMAL, UNIFORM)
    func, args, kwargs = fill
    torch.manual_seed(3)
    eager = call(torch.empty(shape))
    torch.manual_seed(3)
    flat = func(torch.empty(math.prod(shape)), *args, **kwargs)
    assert torch.equal(flat, eager.flatten())


NOT_DENSE = {
    "a view": lambda w: w[1:].normal_(),
    "two fills": lambda w: (w.normal_(), w.uniform_()),
    "an explicit generator": lambda w: w.normal_(generator=torch.Generator()),
    "another random op": lambda w: w.bernoulli_(0.5),
    "a fill and a write": lambda w: (w.normal_(), w.mul_(2)),
    "trunc_normal_ (nothing on meta)": lambda w: nn.init.trunc_normal_(w),
    "orthogonal_ (nothing on meta)": lambda w: nn.init.orthogonal_(w),
    "a write only": lambda w: w.fill_(1.0),
}


@pytest.mark.parametrize("name", list(NOT_DENSE))
def test_anything_but_one_dense_fill_of_the_whole_tensor_is_not_one(name: str) -> None:
    assert _fill_of(NOT_DENSE[name]) is None


def test_rows_of_cuts_as_torch_chunk_does() -> None:
    for rows in range(0, 23):
        for parts in range(1, 10):
            chunks = torch.arange(rows).chunk(parts) if rows else ()
            for index in range(parts):
                lo, hi = rows_of(rows, parts, index)
                want = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(lo, hi)) == want, (rows, parts, index)


@pytest.fixture
def partial_draws_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The recorder's partial draw with the CPU's full draw of the fill standing in for the device's
    (the same values and stream on the CPU); returns the list of elements it drew per call."""
    drawn: list[int] = []

    def full_then_rows(fill, numel, dtype, device, start, end):
        func, args, kwargs = fill
        drawn.append(numel)
        return func(torch.empty(numel, dtype=dtype, device=device), *args, **kwargs)[start:end]

    monkeypatch.setattr("minifabric.init.draws.draw_part", full_then_rows)
    return drawn


def _model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 9), nn.Conv2d(3, 5, 2), nn.Linear(9, 1))
    nn.init.trunc_normal_(model[3].weight, std=0.02)  # not a dense fill: drawn whole
    return model


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_the_recorder_keeps_the_rows_a_partial_draw_gives_and_the_stream_moves_as_in_eager(
    parts: int, partial_draws_on_cpu: list[int]
) -> None:
    torch.manual_seed(0)
    eager = _model()
    after_eager = torch.get_rng_state()
    for rank in range(parts):
        torch.manual_seed(0)
        with meta_init_context(keep=(parts, rank)):
            model = _model()
        assert torch.equal(torch.get_rng_state(), after_eager)
        for (name, p), want in zip(model.named_parameters(), eager.parameters(), strict=True):
            kept = handle_of(p).base.kept
            if name in ("1.weight", "1.bias", "2.weight", "2.bias", "0.weight"):
                assert kept is not None and kept[0] == (parts, rank), name
            if kept is not None:
                lo, hi = rows_of(want.shape[0], parts, rank)
                assert torch.equal(kept[1], want.detach()[lo:hi]), (rank, name)
    assert partial_draws_on_cpu  # the embedding, the linear and conv layers' fills took the partial path


def test_a_tensor_kept_in_part_replays_whole_from_the_state_the_partial_draw_started_at(
    partial_draws_on_cpu: list[int],
) -> None:
    torch.manual_seed(0)
    eager = _model()
    torch.manual_seed(0)
    with meta_init_context(keep=(3, 1)):
        model = _model()
    assert partial_draws_on_cpu
    materialize(model)  # plain tensors: the kept rows are not the placement, so everything is replayed
    for a, b in zip(eager.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _bert() -> nn.Module:
    import transformers as tf

    config = tf.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=64,
        max_position_embeddings=32, pad_token_id=3,
    )  # fmt: skip
    return tf.BertForMaskedLM(config)  # normal_ fills, then the padding row zeroed (its kept part stale)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_transformers_models_guarded_inits_keep_the_rows_of_eager_construction(
    family: str, partial_draws_on_cpu: list[int]
) -> None:
    """transformers wraps ``torch.nn.init`` while it initializes weights; the fills seen through the
    wrappers are the ones eager construction runs, at each rank of 2 and 3: the kept rows, the stream
    after construction and the replayed model are eager construction's."""
    pytest.importorskip("transformers")
    from tests import hf_tiny

    build = _bert if family == "bert" else lambda: hf_tiny.build("llama")
    torch.manual_seed(0)
    eager = build()
    after_eager = torch.get_rng_state()
    for parts, rank in [(2, 1), (3, 2)]:
        partial_draws_on_cpu.clear()
        torch.manual_seed(0)
        with meta_init_context(keep=(parts, rank)):
            model = build()
        assert torch.equal(torch.get_rng_state(), after_eager)
        assert partial_draws_on_cpu  # the embeddings' and linear layers' normal_ fills
        for (name, p), want in zip(model.named_parameters(), eager.parameters(), strict=True):
            kept = handle_of(p).base.kept
            if kept is not None:
                lo, hi = rows_of(want.shape[0], parts, rank)
                assert torch.equal(kept[1], want.detach()[lo:hi]), (parts, rank, name)
        materialize(model)
        for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(a, b), (parts, rank, name)
