"""Safetensors interop in one process: the file format, load_raw of safetensors, and the export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from minifabric import Accelerator, CheckpointError, export_safetensors
from minifabric.checkpoint.hf.files import Item, parse_size, plan_shards, read_box, read_header, write_file
from minifabric.cli import main as cli


class Tiny(nn.Module):
    """An embedding tied to the output head, like GPT-2, and an int buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.arange(3))


def _acc() -> Accelerator:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    return acc


def _setup(seed: int = 0) -> tuple[Accelerator, nn.Module]:
    acc = _acc()
    torch.manual_seed(seed)
    return acc, acc.setup(Tiny())


def _stored(model: nn.Module) -> dict[str, torch.Tensor]:
    """What Hugging Face stores: the tied head once, under the embedding's name."""
    return {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_read_box_matches_slicing(tmp_path: Path, dtype: torch.dtype) -> None:
    full = (torch.randn(6, 5, 4) * 10).to(dtype)
    save_file({"a": torch.zeros(3), "t": full}, tmp_path / "f.safetensors")
    stored = read_header(tmp_path / "f.safetensors")["t"]
    boxes = [((0, 0, 0), (6, 5, 4)), ((3, 0, 0), (3, 5, 4)), ((0, 2, 0), (6, 3, 4)), ((1, 1, 1), (2, 3, 2)),
             ((5, 4, 0), (1, 1, 4)), ((2, 0, 0), (0, 5, 4))]  # fmt: skip
    with open(tmp_path / "f.safetensors", "rb", buffering=0) as f:
        for offsets, lengths in boxes:
            out = torch.empty(lengths, dtype=dtype)
            read_box(f, stored, offsets, out)
            expected = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
            assert torch.equal(out, expected), (offsets, lengths)


def test_writer_streams_files_that_safetensors_reads(tmp_path: Path) -> None:
    tensors = {"b": torch.randn(3, 3).bfloat16(), "a": torch.arange(5), "m": torch.tensor([True, False])}
    items = [Item(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    assert write_file(tmp_path / "x.safetensors", items, write=True) is None
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    shards = plan_shards(items, max_shard_size=20)
    assert [name for name, _ in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [name for name, _ in plan_shards(items, None)] == ["model.safetensors"]
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1MiB") == 2**20 and parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_load_file_folder_and_tied(tmp_path: Path) -> None:
    _, source = _setup(seed=0)
    save_file(_stored(source), tmp_path / "w.safetensors")
    (tmp_path / "folder").mkdir()
    save_file(_stored(source), tmp_path / "folder" / "model.safetensors")
    for path in (tmp_path / "w.safetensors", tmp_path / "folder"):
        acc, model = _setup(seed=1)
        acc.load_raw(path, model)
        assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
        assert model.head.weight is model.emb.weight


def test_load_sharded_folder_with_key_map_and_dtype(tmp_path: Path) -> None:
    _, source = _setup(seed=0)
    stored = {f"net.{k}": v.bfloat16() if v.is_floating_point() else v for k, v in _stored(source).items()}
    save_file({k: v for k, v in stored.items() if "emb" in k}, tmp_path / "model-00001-of-00002.safetensors")
    save_file(
        {k: v for k, v in stored.items() if "emb" not in k}, tmp_path / "model-00002-of-00002.safetensors"
    )
    weight_map = {k: f"model-0000{1 if 'emb' in k else 2}-of-00002.safetensors" for k in stored}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for key_map in (lambda name: name.removeprefix("net."), {k: k[4:] for k in stored}):
        acc, model = _setup(seed=1)
        acc.load_raw(tmp_path, model, key_map=key_map)
        for k, v in model.state_dict().items():
            assert v.dtype == source.state_dict()[k].dtype
            assert torch.equal(v, stored[f"net.{k.replace('head', 'emb')}"].to(v.dtype)), k


def test_mismatches_raise_before_anything_changes(tmp_path: Path) -> None:
    _, source = _setup(seed=0)
    prefixed = {f"net.{k}": v for k, v in _stored(source).items()}
    save_file(prefixed, tmp_path / "prefixed.safetensors")
    bad_shape = {**_stored(source), "mid.weight": torch.zeros(4, 5)}
    save_file(bad_shape, tmp_path / "shape.safetensors")
    acc, model = _setup(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"missing from the file: .*emb.weight \(did you mean 'net\.emb\.weight'\?\).*removeprefix\('net\.'\)",
    ):
        acc.load_raw(tmp_path / "prefixed.safetensors", model)
    with pytest.raises(CheckpointError, match=r"shape mismatch: mid.weight: file \(4, 5\), model \(4, 4\)"):
        acc.load_raw(tmp_path / "shape.safetensors", model, strict=False)
    with pytest.raises(TypeError, match="key_map must be"):
        acc.load_raw(tmp_path / "prefixed.safetensors", model, key_map=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in the file"):
        acc.load_raw(tmp_path / "prefixed.safetensors", model, key_map={"emb.weight": "x"})
    with pytest.raises(ValueError, match="maps both"):
        acc.load_raw(tmp_path / "prefixed.safetensors", model, key_map=lambda name: "same")
    data = (tmp_path / "prefixed.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="truncated"):
        acc.load_raw(tmp_path / "cut.safetensors", model, key_map=lambda name: name[4:])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    with pytest.warns(UserWarning, match=r"strict=False; not loaded: .*mid\.bias"):
        acc.load_raw(tmp_path / "prefixed.safetensors", model, strict=False,
                     key_map=lambda name: None if "mid.bias" in name else name[4:])  # fmt: skip
    assert torch.equal(model.mid.weight, source.mid.weight) and torch.equal(
        model.mid.bias, before["mid.bias"]
    )


def test_load_before_setup_is_a_wrong_call_order(tmp_path: Path) -> None:
    acc = _acc()
    with acc.init_module(empty_init=True):
        model = Tiny()
    save_file(_stored(Tiny()), tmp_path / "w.safetensors")
    with pytest.raises(RuntimeError, match=r"acc.setup\(model\)"):
        acc.load_raw(tmp_path / "w.safetensors", model)


def test_export_live_and_from_checkpoints(tmp_path: Path) -> None:
    acc, model = _setup(seed=0)
    acc.save(tmp_path / "live", {"model": model}, format="safetensors")
    acc.save(tmp_path / "ckpt.pt", {"model": model, "step": 3})
    acc.strategy.state_dict_type = "sharded"
    acc.save(tmp_path / "sharded", {"model": model, "step": 3})
    export_safetensors(tmp_path / "ckpt.pt", tmp_path / "from-file")
    export_safetensors(tmp_path / "sharded", tmp_path / "one.safetensors", dtype="bf16")
    expected = _stored(model)
    for path in (tmp_path / "live" / "model.safetensors", tmp_path / "from-file" / "model.safetensors"):
        loaded = load_file(path)
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    loaded = load_file(tmp_path / "one.safetensors")
    assert loaded["steps"].dtype == torch.int64 and loaded["mid.weight"].dtype == torch.bfloat16
    assert (
        torch.equal(loaded["emb.weight"], expected["emb.weight"].bfloat16()) and "head.weight" not in loaded
    )

    cli([
        "consolidate", str(tmp_path / "sharded"), str(tmp_path / "capped"), "--format", "safetensors",
        "--max-shard-size", "100", "--dtype", "fp16",
    ])  # fmt: skip
    index = json.loads((tmp_path / "capped" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / "capped" / file, "pt") as f:
            assert f.get_tensor(name).dtype == (torch.int64 if name == "steps" else torch.float16)
    # a smaller re-export into the same folder leaves no shard of the earlier one behind
    export_safetensors(tmp_path / "sharded", tmp_path / "capped")
    assert sorted(p.name for p in (tmp_path / "capped").iterdir()) == ["model.safetensors"]


def test_export_options_are_checked_before_writing(tmp_path: Path) -> None:
    wrapper = nn.ModuleDict({"model": Tiny()})
    acc = _acc()
    wrapper = acc.setup(wrapper)
    acc.save(tmp_path / "ckpt.pt", {"model": wrapper})
    export_safetensors(tmp_path / "ckpt.pt", tmp_path / "stripped", strip_prefix="model.")
    assert set(load_file(tmp_path / "stripped" / "model.safetensors")) == {
        "emb.weight",
        "mid.weight",
        "mid.bias",
        "steps",
    }
    with pytest.raises(ValueError, match=r"strip_prefix='mo\.'.*do not start with it"):
        export_safetensors(tmp_path / "ckpt.pt", tmp_path / "x", strip_prefix="mo.")
    with pytest.raises(ValueError, match="not a floating dtype"):
        export_safetensors(tmp_path / "ckpt.pt", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="needs a folder"):
        export_safetensors(tmp_path / "ckpt.pt", tmp_path / "x.safetensors", max_shard_size="1GB")
    with pytest.raises(ValueError, match="writes one model"):
        acc.save(tmp_path / "x", {"model": wrapper, "step": 1}, format="safetensors")
    with pytest.raises(ValueError, match="asynchronous"):
        acc.save(tmp_path / "x", {"model": wrapper}, format="safetensors", asynchronous=True)
    with pytest.raises(ValueError, match="format='onnx' is unknown"):
        acc.save(tmp_path / "x", {"model": wrapper}, format="onnx")  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="need --format safetensors"):
        cli(["consolidate", str(tmp_path / "ckpt.pt"), str(tmp_path / "x.pt"), "--dtype", "bf16"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.safetensors").exists()


def test_untied_weights_into_a_tied_model_are_refused_naming_both_and_the_flag(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False))
    untied.save_pretrained(tmp_path / "untied")
    acc = _acc()
    tied = acc.setup(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=True))
    )
    before = {k: v.clone() for k, v in tied.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        acc.load_raw(tmp_path / "untied", tied)
    message = str(caught.value)
    assert "'model.embed_tokens.weight'" in message and "'lm_head.weight'" in message, message
    assert "tie_word_embeddings=True" in message and "tie_word_embeddings=False" in message, message
    assert all(torch.equal(v, before[k]) for k, v in tied.state_dict().items())
    # the same tensor stored under both names is no conflict
    _, source = _setup(seed=0)
    both = {k: v.clone() for k, v in source.state_dict().items()}
    save_file(both, tmp_path / "both.safetensors")
    acc, model = _setup(seed=1)
    acc.load_raw(tmp_path / "both.safetensors", model)
    assert torch.equal(model.emb.weight, source.emb.weight) and model.head.weight is model.emb.weight


def test_load_raw_of_a_folder_of_model_folders_says_what_it_found_and_expected(tmp_path: Path) -> None:
    _, source = _setup(seed=0)
    (tmp_path / "runs" / "llama").mkdir(parents=True)
    (tmp_path / "runs" / "gpt2").mkdir()
    save_file(_stored(source), tmp_path / "runs" / "llama" / "model.safetensors")
    acc, model = _setup(seed=1)
    with pytest.raises(CheckpointError) as caught:
        acc.load_raw(tmp_path / "runs", model)
    message = str(caught.value)
    assert "gpt2/" in message and "llama/" in message, message
    assert "model.safetensors" in message and "index.json" in message, message
    assert "['llama']" in message and "sharded checkpoint folder" not in message, message
