"""The shard reader: every tensor layout read back exactly, mapped views that never outlive a load,
damaged files reported by name, and a load that reads the model's weights through the mapping."""

from __future__ import annotations

import gc
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from minifabric import Accelerator
from minifabric.checkpoint import CheckpointError, archive, reader
from minifabric.checkpoint import read as sharded

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")


def _saved_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(4, 3).bfloat16(),
        "f16": torch.randn(3, 3).half(),
        "i64": torch.arange(10),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "bool": torch.randn(6) > 0,
        "c64": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 5).t(),  # saved with its strides: not contiguous
        "sliced": torch.randn(10, 4)[2:5],  # a view into a larger storage
        "big": torch.randn(256, 1024),
    }


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def _mapped_files(folder: Path) -> list[str]:
    """The lines of this process's memory map that map a file under ``folder``."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]


@pytest.mark.parametrize("views", [False, True])
def test_every_layout_and_dtype_is_read_exactly(tmp_path: Path, views: bool) -> None:
    saved = _saved_tensors()
    _save(tmp_path, saved)
    targets = {key: torch.full_like(value.contiguous(), 7) for key, value in saved.items()}
    sharded.read_tensors(tmp_path, targets, views=set(saved) if views else ())
    for key, value in saved.items():
        assert targets[key].dtype == value.dtype and targets[key].shape == value.shape, key
        assert torch.equal(targets[key], value), key


def test_another_target_dtype_is_converted_like_a_copy(tmp_path: Path) -> None:
    saved = {"w": torch.randn(8, 4).bfloat16(), "v": torch.randn(4)}
    _save(tmp_path, saved)
    targets = {"w": torch.empty(8, 4), "v": torch.empty(4, dtype=torch.float64)}
    sharded.read_tensors(tmp_path, targets, views={"w", "v"})  # no view: the dtypes differ
    assert targets["w"].dtype == torch.float32 and torch.equal(targets["w"], saved["w"].float())
    assert torch.equal(targets["v"], saved["v"].double())


def test_a_region_of_a_saved_chunk_is_read(tmp_path: Path) -> None:
    """Reading a part of a saved chunk (as a rank does after resharding) takes exactly that part."""
    from torch.distributed.checkpoint.planner import ReadItem

    whole = torch.randn(6, 5)
    _save(tmp_path, {"w": whole})
    shard = next(tmp_path.glob("*.distcp"))
    metadata = reader.SafeReader(tmp_path).read_metadata()
    info = next(iter(metadata.storage_data.values()))
    with open(shard, "rb", buffering=0) as file:
        saved = archive.locate(file, info.offset, info.length)
        for offsets, lengths in [((2, 0), (3, 5)), ((1, 2), (4, 2)), ((5, 4), (1, 1))]:
            item = ReadItem(
                type=None, dest_index=None, dest_offsets=None, storage_index=None,
                storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths),
            )  # fmt: skip
            target = torch.empty(lengths)
            reader._read_region(file, saved, item, target)
            expected = whole[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
            assert torch.equal(target, expected), (offsets, lengths)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_views_map_the_shard_file_and_the_mapping_ends_with_them(tmp_path: Path) -> None:
    saved = {"w": torch.randn(512, 512), "b": torch.randn(512)}
    _save(tmp_path, saved)
    given = {key: torch.empty_like(value) for key, value in saved.items()}
    targets = dict(given)
    sharded.read_tensors(tmp_path, targets, views={"w"})
    assert targets["w"] is not given["w"] and targets["b"] is given["b"]  # only "w" may be a view
    assert torch.equal(targets["w"], saved["w"]) and torch.equal(targets["b"], saved["b"])
    assert _mapped_files(tmp_path), "the view should be a mapping of the shard file"
    del targets
    gc.collect()
    assert not _mapped_files(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_shard_file_is_named(tmp_path: Path, damage: str) -> None:
    saved = {"w": torch.randn(64, 64)}
    _save(tmp_path, saved)
    shard = next(tmp_path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\0" * len(data))
    target = torch.zeros(64, 64)
    for views in ((), {"w"}):
        with pytest.raises(CheckpointError, match=r"\.distcp' is damaged: 'w'"):
            sharded.read_tensors(tmp_path, {"w": target}, views=views)
        assert torch.equal(target, torch.zeros(64, 64))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_load_reads_the_weights_through_the_mapping_and_keeps_nothing_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    acc.strategy.state_dict_type = "sharded"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(4, 32)).sum())
    optimizer.step()
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}

    viewed = []
    original = reader._Mapped.view
    monkeypatch.setattr(reader._Mapped, "view", lambda self, *a: viewed.append(1) or original(self, *a))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no state yet: the moments are read
    acc.load(tmp_path / "ckpt", {"model": model, "optimizer": fresh})
    gc.collect()
    assert len(viewed) == len(expected)  # every weight read through the mapping
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[k]) for k, v in fresh.state_dict()["state"][0].items())
    assert not _mapped_files(tmp_path)  # optimizer state is held in memory, never in a mapped file


def test_a_tensor_with_the_conjugate_or_negative_bit_is_read_as_its_values(tmp_path: Path) -> None:
    """The stored values of a conjugated view are the unconjugated ones: such records go to ``torch.load``."""
    saved = {"conj": torch.tensor([1 + 2j, 3 - 4j]).conj(), "w": torch.randn(4, 4)}
    _save(tmp_path, saved)
    for views in ((), set(saved)):
        targets = {key: torch.zeros_like(value.resolve_conj()) for key, value in saved.items()}
        sharded.read_tensors(tmp_path, targets, views=views)
        assert torch.equal(targets["conj"], saved["conj"].resolve_conj()) and torch.equal(
            targets["w"], saved["w"]
        )


class _KeepsExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.stats = torch.zeros(4096)

    def get_extra_state(self) -> torch.Tensor:
        return self.stats

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.stats = state  # keeps the tensor it is given


def _single(tmp_path: Path) -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    acc.strategy.state_dict_type = "sharded"
    return acc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_extra_state_kept_by_the_module_is_not_a_view_of_the_file(tmp_path: Path) -> None:
    acc = _single(tmp_path)
    model = _KeepsExtraState()
    model.stats += 3
    acc.save(tmp_path / "ckpt", {"model": model})
    fresh = _KeepsExtraState()
    acc.load(tmp_path / "ckpt", {"model": fresh})
    gc.collect()
    assert torch.equal(fresh.stats, model.stats) and torch.equal(fresh.layer.weight, model.layer.weight)
    assert not _mapped_files(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_failed_read_leaves_no_file_mapped_and_the_model_unchanged(tmp_path: Path) -> None:
    acc = _single(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    acc.backward(model(torch.randn(2, 64)).sum())
    optimizer.step()
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    shard = next((tmp_path / "ckpt").glob("v*/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-2048:] = bytes(2048)  # the optimizer's records, read after the model's weights were mapped
    shard.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gc.disable()
    try:
        with pytest.raises(CheckpointError, match="damaged"):
            acc.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
        assert not _mapped_files(tmp_path)
    finally:
        gc.enable()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "damage",
    [
        (b"QK\x00K\x04\x85", b"QK\x01K\x04\x85"),  # storage_offset 0 -> 1: one element past the storage
        (b"q\x06K\x01\x85", b"q\x06K\x02\x85"),  # stride 1 -> 2: reaches element 6 of 4
    ],
    ids=["storage_offset", "stride"],
)
def test_damaged_tensor_metadata_is_refused_naming_file_and_key(tmp_path: Path, damage: tuple) -> None:
    saved = {"a": torch.randn(4), "b": torch.randn(4)}
    _save(tmp_path, saved)
    shard = next(tmp_path.glob("*.distcp"))
    data = shard.read_bytes()
    assert data.count(damage[0]) == 2  # both records; damage the first one only
    shard.write_bytes(data.replace(damage[0], damage[1], 1))
    for views in ((), {"a", "b"}):
        targets = {"a": torch.zeros(4), "b": torch.zeros(4)}
        with pytest.raises(CheckpointError, match=r"\.distcp' is damaged: '[ab]'.*storage"):
            sharded.read_tensors(tmp_path, dict(targets), views=views)


@pytest.mark.parametrize(
    "layout",
    [
        ((4,), (1,), -1),
        ((4,), (-1,), 3),
        ((-1,), (1,), 0),
        ((2, 2), (2,), 0),
        ((5,), (1,), 0),
        ((2,), (3,), 1),
    ],
)
def test_layouts_outside_their_storage_are_refused(layout: tuple) -> None:
    size, stride, offset = layout
    with pytest.raises(zipfile.BadZipFile, match=r"layout|storage"):
        archive.check_layout(size, stride, offset, 4)
    archive.check_layout((0,), (1,), 4, 4)  # empty: nothing to read
    archive.check_layout((2, 2), (2, 1), 0, 4)


class _KeepsItsBuffer(nn.Module):
    """A cache whose length varies: loading keeps the tensor it is given instead of copying into it."""

    def __init__(self, length: int = 2) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(length, 8))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.cache = state_dict[prefix + "cache"]  # kept as given (its length may differ from the live one)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_module_that_keeps_the_loaded_tensor_keeps_no_file_mapped(tmp_path: Path) -> None:
    acc = _single(tmp_path)
    model = _KeepsItsBuffer(length=2)
    model.cache += 3
    acc.save(tmp_path / "ckpt", {"model": model})
    fresh = _KeepsItsBuffer(length=2)
    acc.load(tmp_path / "ckpt", {"model": fresh})
    gc.collect()
    assert torch.equal(fresh.cache, model.cache) and torch.equal(fresh.layer.weight, model.layer.weight)
    assert not _mapped_files(tmp_path)


class _KeepsWhatItLoads(nn.Sequential):
    """Keeps every tensor of the state dict ``load_state_dict`` was given."""

    def load_state_dict(self, state_dict, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.kept = dict(state_dict)
        return super().load_state_dict(state_dict, *args, **kwargs)


def _pre_hooked() -> nn.Module:
    """A model whose inner module keeps the tensors its load pre-hook sees (a key migration that caches)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    model[1].kept = {}
    model[1].register_load_state_dict_pre_hook(
        lambda module, state_dict, prefix, *_: module.kept.update(
            {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        )
    )
    return model


def _shared_pre_hooked() -> nn.Module:
    """One module under two names: its pre-hook runs once per name."""
    shared = _pre_hooked()[1]
    return nn.ModuleDict({"x": shared, "y": shared})


def _instance_overrides(method: str) -> nn.Module:
    """``load_state_dict`` or a submodule's ``_load_from_state_dict`` replaced on the instance."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    target = model if method == "load_state_dict" else model[1]  # sees its children's tensors too
    original = getattr(target, method)

    def keeping(state_dict, *args, **kwargs):  # type: ignore[no-untyped-def]
        target.kept = dict(state_dict)
        return original(state_dict, *args, **kwargs)

    setattr(target, method, keeping)
    return model


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize(
    "build",
    [
        _pre_hooked,
        _shared_pre_hooked,
        lambda: _KeepsWhatItLoads(nn.Linear(8, 8), nn.Linear(8, 2)),
        lambda: _instance_overrides("load_state_dict"),
        lambda: _instance_overrides("_load_from_state_dict"),
    ],
    ids=[
        "pre-hook",
        "shared-module-pre-hook",
        "load_state_dict",
        "instance-load_state_dict",
        "instance-_load_from_state_dict",
    ],
)
def test_a_load_hook_or_load_state_dict_that_keeps_tensors_keeps_no_file_mapped(
    tmp_path: Path, build
) -> None:
    acc = _single(tmp_path)
    torch.manual_seed(0)
    model = build()
    acc.save(tmp_path / "ckpt", {"model": model})
    fresh = build()
    acc.load(tmp_path / "ckpt", {"model": fresh})
    gc.collect()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    assert not _mapped_files(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_optimizer_state_loads_into_the_live_state_tensors_and_keeps_nothing_mapped(tmp_path: Path) -> None:
    acc = _single(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(2, 64)).sum())
    optimizer.step()
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    saved = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    acc.backward(model(torch.randn(2, 64)).sum())
    optimizer.step()  # the live state moves on
    live = optimizer.optimizer.state[next(iter(model.parameters()))]
    pointers = {k: v.data_ptr() for k, v in live.items()}
    acc.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    gc.collect()
    now = optimizer.optimizer.state[next(iter(model.parameters()))]
    assert {k: v.data_ptr() for k, v in now.items()} == pointers  # copied into, no new memory
    assert all(torch.equal(now[k], saved[k]) for k in saved)
    assert not _mapped_files(tmp_path)


def _fsdp(tmp_path: Path) -> Accelerator:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=1)
    acc.launch()
    return acc


def test_fsdp_own_load_hooks_still_let_weights_be_read_as_mapped_views(tmp_path: Path) -> None:
    """FSDP2 puts a load pre-hook on every module it shards (at the first forward); it keeps nothing."""
    from minifabric._arguments import unwrap_state
    from minifabric.checkpoint.load import _views

    acc = _fsdp(tmp_path)
    model = acc.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    acc.backward(model(torch.randn(2, 4)).sum())
    inner = unwrap_state({"model": model})["model"]
    assert all(sub._load_state_dict_pre_hooks for sub in inner)  # FSDP's own
    plan = type("Plan", (), {"trees": {}})()
    assert _views({"model": inner}, plan)["model"] == {(n,) for n, _ in inner.named_parameters()}


class _PlainMoment(torch.optim.SGD):
    """Keeps a plain-tensor moment per parameter, whatever the parameter's layout (a DTensor under FSDP)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["m"] = torch.full(tuple(p.shape), 2.0)
        return super().step(closure)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_optimizer_state_laid_out_unlike_its_parameter_keeps_no_file_mapped(tmp_path: Path) -> None:
    acc = _fsdp(tmp_path)
    model = nn.Linear(4, 4)
    model, optimizer = acc.setup(model, _PlainMoment(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    acc.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    gc.collect()
    assert not _mapped_files(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("what", ["fresh-optimizer", "kept-buffer"])
def test_a_one_file_checkpoint_keeps_no_file_mapped(tmp_path: Path, what: str) -> None:
    """A one-file checkpoint is mapped whole; what ``load`` hands over instead of copying is copied out."""
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    assert acc.strategy.state_dict_type == "full"  # one file
    torch.manual_seed(0)
    if what == "kept-buffer":
        model = _KeepsItsBuffer(length=2)
        acc.save(tmp_path / "ckpt", {"model": model})
        fresh = _KeepsItsBuffer(length=2)
        acc.load(tmp_path / "ckpt", {"model": fresh})
        assert torch.equal(fresh.cache, model.cache)
    else:
        model = nn.Linear(8, 8)
        model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        acc.backward(model(torch.randn(2, 8)).sum())
        optimizer.step()
        acc.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
        saved = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
        fresh = nn.Linear(8, 8)
        fresh, fresh_optimizer = acc.setup(
            fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        )  # no state yet
        acc.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_optimizer})
        loaded = fresh_optimizer.state_dict()["state"][0]
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    gc.collect()
    assert (tmp_path / "ckpt").is_file()
    assert not _mapped_files(tmp_path)
