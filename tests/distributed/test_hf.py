"""Hugging Face interop on 2 FSDP ranks: pretrained safetensors into shards, training, HF-ready export.

A tiny LlamaForCausalLM (saved as shards with an index) and a tiny GPT-2 with tied embeddings (one
file) are loaded into meta-init FSDP models; every weight must equal the source and each rank must
read about half of the bytes. After a few steps the model is exported and read back by
``AutoModelForCausalLM.from_pretrained``: same logits, no missing or unexpected keys, ties kept.
A sharded checkpoint of the trained model is exported by one process, and its peak memory measured.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import minifabric.checkpoint.hf
import minifabric.checkpoint.service  # noqa: F401  (likewise)
from minifabric import Accelerator
from tests.helpers import PYTHON, REPO, run_command, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
safe_open = pytest.importorskip("safetensors").safe_open


def _configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        ),
        "gpt2": transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0,
        ),
    }  # fmt: skip


def _build(name: str) -> torch.nn.Module:
    config = _configs()[name]
    cls = transformers.LlamaForCausalLM if name == "llama" else transformers.GPT2LMHeadModel
    return cls(config)


def _rchar() -> int:
    """Bytes this process has read with read()/pread() so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def _rank(rank: int, root: str) -> dict:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    acc.launch()
    out: dict = {}
    torch.manual_seed(100 + rank)  # different init per rank: loading must overwrite all of it
    with acc.init_module(empty_init=True):
        models = {name: _build(name) for name in ("llama", "gpt2")}
    for name, model in models.items():
        source = Path(root) / f"{name}-pretrained"
        model = acc.setup(model)
        before = _rchar()
        acc.load_raw(source, model)
        read = _rchar() - before
        files = [f for f in source.iterdir() if f.suffix == ".safetensors"]
        expected = {}
        for file in files:
            expected.update(safetensors_torch.load_file(file))
        live = model.state_dict()
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in live.items()}
        mismatched = [k for k, v in expected.items() if not torch.equal(full[k], v)]
        tied = name != "gpt2" or model.lm_head.weight is model.transformer.wte.weight

        optimizer = acc.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        model.train()
        for step in range(3):
            logits = model(_batch(step)).logits
            acc.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), _batch(step).flatten()))
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            trained_logits = model(_batch(99)).logits
        acc.save(Path(root) / f"{name}-export", {"model": model}, format="safetensors")
        acc.save(Path(root) / f"{name}-ckpt", {"model": model, "optimizer": optimizer})
        out[name] = {
            "read": read,
            "total": sum(f.stat().st_size for f in files),
            "mismatched": mismatched,
            "count": len(expected),
            "tied": tied,
            "logits": trained_logits,
        }
    return out


def test_pretrained_into_fsdp_train_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for name in ("llama", "gpt2"):
        shard = "20KB" if name == "llama" else "5GB"
        _build(name).save_pretrained(tmp_path / f"{name}-pretrained", max_shard_size=shard)
    assert (tmp_path / "llama-pretrained" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "gpt2-pretrained" / "model.safetensors").is_file()

    results = run_distributed(_rank, 2, str(tmp_path), timeout=200)

    for name in ("llama", "gpt2"):
        for rank, result in enumerate(results):
            r = result[name]
            assert r["count"] > 10 and r["mismatched"] == [], (name, rank, r["mismatched"])
            assert r["tied"], (name, rank)
            share = r["read"] / r["total"]
            print(f"{name} rank {rank}: read {r['read']} of {r['total']} bytes ({share:.2f})")
            assert 0.4 < share < 0.6, (name, rank, share)
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / f"{name}-export", output_loading_info=True
        )
        assert not any(info.values()), info
        if name == "gpt2":
            assert exported.lm_head.weight is exported.transformer.wte.weight
            with open(tmp_path / "gpt2-export" / "model.safetensors", "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            assert "transformer.wte.weight" in header and "lm_head.weight" not in header
        with torch.no_grad():
            logits = exported.eval()(_batch(99)).logits
        for result in results:
            torch.testing.assert_close(result[name]["logits"], logits, rtol=0, atol=1e-6)

    # The trained GPT-2's sharded checkpoint, exported by the command line in bf16 as capped shards.
    out = tmp_path / "gpt2-bf16"
    cmd = [PYTHON, "-m", "minifabric", "consolidate", str(tmp_path / "gpt2-ckpt"), str(out),
           "--format", "safetensors", "--dtype", "bf16", "--max-shard-size", "100KB"]  # fmt: skip
    done = run_command(cmd, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (
        len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
        == len(exported.state_dict()) - 1
    )  # lm_head.weight is stored once, as transformer.wte.weight
    shutil.copy(tmp_path / "gpt2-export" / "config.json", out / "config.json")
    bf16, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.bfloat16
    )
    assert not any(info.values()), info
    assert bf16.lm_head.weight is bf16.transformer.wte.weight
    for key, value in exported.state_dict().items():
        assert torch.equal(bf16.state_dict()[key], value.to(torch.bfloat16)), key


def _save_big(rank: int, root: str, layers: int, width: int) -> None:
    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    acc.launch()
    with acc.init_module(empty_init=True):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = acc.setup(model)
    acc.save(Path(root) / "ckpt", {"model": model})


def test_export_of_a_sharded_checkpoint_streams(tmp_path: Path) -> None:
    """Saved on 2 ranks, exported by 1 process: peak RSS above its start below 1.5x the largest tensor + the model.

    (Measured here: about 13 MiB for this 64 MiB model of 4 MiB tensors; benchmarks/bench_export.py
    reports a larger model.)
    """
    run_distributed(_save_big, 2, str(tmp_path), 16, 1024, timeout=120)
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    cmd = [PYTHON, "benchmarks/bench_export.py", "measure", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    done = run_command(cmd, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    peak, largest, model = result["peak_above_before"], result["largest_tensor_bytes"], result["model_bytes"]
    print(
        f"export peak RSS above start: {peak / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB, model {model / 2**20:.0f} MiB"
    )
    assert peak < 1.5 * largest + model
    assert peak < model / 2  # it streams: nowhere near a copy of the model
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert len(list(f.keys())) == 16
