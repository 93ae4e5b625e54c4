"""Unit tests of each stage and mode of ``setup``'s materialization, on tiny models, against eager construction.

Stages: ``init/places`` (records found and checked), ``init/kept`` (values kept at construction),
``init/replay`` (a value from its recipe), ``init/place`` (storage, and each value in place);
modes: a recorded model (the ``init/materialize`` driver), the self-check (``on_value``), and a
model built under plain ``torch.device("meta")`` (``init/plain_meta``, Lightning Fabric's path).
Every comparison is bitwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from minifabric.init import materialize, meta_init_context, places_to_materialize, recorded_places
from minifabric.init.kept import take_whole_kept
from minifabric.init.place import copy_into_local, place
from minifabric.init.replay import value_of

driver = importlib.import_module("minifabric.init.materialize")  # the package's `materialize` is the function


class Tiny(nn.Module):
    """Random and constant init, a buffer, a tied weight and a view write."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.extra = nn.Parameter(torch.empty(2, 4))
        nn.init.normal_(self.extra, std=0.02)
        self.extra.data[0].zero_()


def _pair(
    build: Callable[[], nn.Module] = Tiny, keep: tuple[int, int] | None = None
) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    eager = build()
    torch.manual_seed(7)
    with meta_init_context(keep=keep):
        meta = build()
    return eager, meta


def _assert_equal(eager: nn.Module, model: nn.Module) -> None:
    a, b = eager.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert not b[name].is_meta and torch.equal(a[name], b[name]), name


def test_places_lists_each_meta_tensor_with_its_record() -> None:
    eager, model = _pair()
    places = recorded_places(model)
    where = sorted(f"{type(sub).__name__}.{name}" for sub, name, _, _ in places)
    # the tied weight is in two places; the buffer computed for real is not a meta tensor
    assert where == sorted(
        ["Embedding.weight", "LayerNorm.weight", "LayerNorm.bias", "Linear.weight", "Tiny.extra"]
    )
    assert not model.scale.is_meta and torch.equal(model.scale, eager.scale)


def test_replay_gives_each_eager_value() -> None:
    eager, model = _pair()
    values = {
        f"{type(sub).__name__}.{name}": value_of(handle) for sub, name, _, handle in recorded_places(model)
    }
    assert torch.equal(values["Embedding.weight"], eager.embed.weight)
    assert torch.equal(values["Linear.weight"], eager.embed.weight)
    assert torch.equal(values["Tiny.extra"], eager.extra)
    assert torch.equal(values["LayerNorm.bias"], eager.norm.bias)


def test_a_kept_whole_value_is_eager_and_used_once() -> None:
    eager, model = _pair(keep=(1, 0))
    (_, _, _, handle), *_ = (
        p for p in recorded_places(model) if p[1] == "weight" and isinstance(p[0], nn.Embedding)
    )
    kept = take_whole_kept(model.embed.weight, handle)
    assert kept is not None and torch.equal(kept, eager.embed.weight)
    assert take_whole_kept(model.embed.weight, handle) is None  # consumed: two models never share it


def test_nothing_is_kept_without_keep() -> None:
    _, model = _pair()
    assert all(take_whole_kept(model.embed.weight, h) is None for *_, h in recorded_places(model))


def test_place_replaces_a_plain_parameter_in_its_dtype() -> None:
    old = nn.Parameter(torch.empty(2, 3, dtype=torch.bfloat16, device="meta"), requires_grad=False)
    full = torch.arange(6.0).reshape(2, 3)
    new = place(old, full, "cpu")
    assert isinstance(new, nn.Parameter) and not new.requires_grad
    assert new.dtype == torch.bfloat16 and torch.equal(new, full.to(torch.bfloat16))


def test_copy_into_local_writes_nothing_on_a_shape_mismatch() -> None:
    target = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3\) vs \(3, 2\)"):
        copy_into_local(target, torch.ones(3, 2), lambda here, got: ValueError(f"{here} vs {got}"))
    assert torch.equal(target, torch.zeros(2, 3))
    copy_into_local(target, torch.ones(2, 3), lambda here, got: ValueError("unused"))
    assert torch.equal(target, torch.ones(2, 3))


@pytest.mark.parametrize("keep", [None, (1, 0)])
def test_the_driver_materializes_a_recorded_model_as_eager(keep: tuple[int, int] | None) -> None:
    eager, model = _pair(keep=keep)
    assert places_to_materialize(model, "cpu")
    materialize(model)
    _assert_equal(eager, model)
    assert model.head.weight is model.embed.weight  # tied weights stay one parameter


def test_the_driver_uses_the_kept_value_instead_of_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    eager, model = _pair(lambda: nn.Linear(3, 5), keep=(1, 0))
    replayed = []
    monkeypatch.setattr(driver, "value_of", lambda handle: replayed.append(handle) or value_of(handle))
    materialize(model)
    _assert_equal(eager, model)
    assert replayed == []  # each first random write kept its value: nothing run a second time
    _, model = _pair(lambda: nn.Linear(3, 5))
    materialize(model)
    assert len(replayed) == 2  # nothing kept: both replayed


def test_the_self_check_sees_every_value_replayed() -> None:
    eager, model = _pair(keep=(1, 0))
    seen: dict[str, torch.Tensor] = {}
    materialize(model, on_value=lambda name, full: seen.setdefault(name, full))
    _assert_equal(eager, model)
    assert sorted(seen) == ["embed.weight", "extra", "norm.bias", "norm.weight"]
    assert all(torch.equal(full, eager.state_dict()[name]) for name, full in seen.items())


def test_plain_meta_mode_runs_reset_parameters_as_lightning_fabric() -> None:
    torch.manual_seed(4)
    eager = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    torch.manual_seed(4)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert places_to_materialize(model, "cpu") == []  # done now: nothing recorded to replay later
    _assert_equal(eager, model)


def test_a_recorded_model_is_not_reset() -> None:
    _, model = _pair(lambda: nn.Linear(3, 4))
    reset: list[int] = []
    model.reset_parameters = lambda: reset.append(1)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="was set after `init_module"):
        places_to_materialize(model, "cpu")
    assert reset == []


@pytest.fixture
def mesh() -> object:
    """A one-rank CPU mesh (the Accelerator's process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifabric import Accelerator

    Accelerator(accelerator="cpu", devices=1, strategy="fsdp").launch()
    return init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("keep", [None, (1, 0)])
def test_dtensor_stages_on_a_sharded_meta_model(mesh: object, keep: tuple[int, int] | None) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from minifabric.init.kept import kept_shards

    eager, model = _pair(lambda: nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)), keep=keep)
    places = recorded_places(model)
    fully_shard(model, mesh=mesh)
    shards = kept_shards(places)
    assert len(shards) == (4 if keep else 0)  # each kept part is exactly this rank's shard
    materialize(model, places)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    assert full.keys() == eager.state_dict().keys()
    assert all(torch.equal(full[name], t) for name, t in eager.state_dict().items())


def test_fill_local_copies_this_ranks_part(mesh: object) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from minifabric.init.place import fill_local

    target = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    value = torch.arange(12.0).reshape(4, 3)
    fill_local(target, value)
    assert torch.equal(target.to_local(), value)
