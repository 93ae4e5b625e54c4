"""Fine-tune a Hugging Face model with FSDP and meta init, then export it for `from_pretrained`.

The weights go straight from safetensors into each rank's shard (no rank ever holds the full
model), training runs sharded, and the result is written as a Hugging Face model folder. So that it
runs anywhere with no download, a tiny randomly initialized Llama stands in for the Hub model: it
is written with `save_pretrained` first, exactly as a downloaded checkpoint would sit on disk. With
a real model, point PRETRAINED at its folder (e.g. from `huggingface_hub.snapshot_download`) and
build it with `AutoConfig.from_pretrained(PRETRAINED)`.

Run (2 processes on CPU, about 40 seconds on a loaded 2-core machine):

    python examples/finetune_hf.py
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from minifabric import Accelerator

OUT = Path("out/finetune_hf")
PRETRAINED = OUT / "pretrained"  # a save_pretrained folder: config.json + model.safetensors
FINETUNED = OUT / "finetuned"
STEPS = 30
CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def batch(generator: torch.Generator) -> torch.Tensor:
    """The task: continue a counting sequence (modulo the vocabulary) from a random start."""
    start = torch.randint(0, CONFIG.vocab_size, (8, 1), generator=generator)
    return (start + torch.arange(24)) % CONFIG.vocab_size


acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
acc.launch()

with acc.rank_zero_first():  # stands in for downloading a model from the Hub
    if acc.is_global_zero and not PRETRAINED.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(CONFIG).save_pretrained(PRETRAINED)

# Build on the meta device (no memory), shard, then read each rank's slices of the safetensors.
with acc.init_module(empty_init=True):
    model = LlamaForCausalLM(CONFIG)
model = acc.setup(model)
acc.load_raw(PRETRAINED, model)
optimizer = acc.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))

generator = torch.Generator().manual_seed(1)  # the same batches on every rank: fine for a demo
model.train()
for step in range(STEPS):
    tokens = batch(generator)
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0 or step == STEPS - 1:
        acc.print(f"step {step:3d}  loss {loss.item():.3f}")

# Every rank calls; rank 0 writes config.json + model.safetensors, ready for from_pretrained.
model.eval()
acc.save(FINETUNED, {"model": model}, format="safetensors")
probe = batch(torch.Generator().manual_seed(2))
with torch.no_grad():
    ours = model(probe).logits
if acc.is_global_zero:
    reloaded = AutoModelForCausalLM.from_pretrained(FINETUNED)
    with torch.no_grad():
        theirs = reloaded(probe).logits
    print(
        f"exported to {FINETUNED}; from_pretrained logits differ by {(ours - theirs).abs().max().item():.1e}"
    )
