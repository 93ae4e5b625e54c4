"""2-D parallelism: tensor parallel inside each group of ranks, FSDP across groups.

A small Llama-style transformer (attention + MLP blocks) is split by a tensor-parallel plan
(Colwise in, Rowwise out, sequence-parallel norms); ``ModelParallelStrategy`` shards what the plan
leaves plain with FSDP over the data-parallel dimension, applies the precision, splits the data by
data-parallel rank, and clips across both meshes. Then a sharded checkpoint is saved and loaded
back at another layout.

Run (4 CPU processes, (dp, tp) = (2, 2), about a minute on 2 cores):

    minifabric run --devices 4 examples/tensor_parallel.py

On GPUs, unchanged (the accelerator is picked up from ``minifabric run``):

    minifabric run --accelerator cuda --devices 4 examples/tensor_parallel.py --precision bf16-mixed

Options: ``--dp 2 --tp auto`` (the mesh: ``auto`` takes the number of processes divided by the
other; their product must be the number of processes), ``--steps``,
``--grad-accum``, ``--dim`` (divisible by ``--n-head`` and ``--tp``), ``--out`` (checkpoint folder).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from minifabric import Accelerator, ModelParallelStrategy


@dataclass
class Config:
    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 96
    n_head: int = 4
    n_layer: int = 4


# ---- the model: nothing in it knows about parallelism --------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_head
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism this rank holds some of the heads: count them from the local width.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)  # not in the plan: FSDP alone shards it
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)  # whole sequence: pos_emb sees all of it
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


# ---- the plan: which layer is split how over the tensor-parallel ranks -------------------------


def parallelize(model: Transformer, device_mesh: DeviceMesh) -> Transformer:
    """Split each block Megatron-style; the residual stream is split along the sequence between blocks.

    Every parameter that sees a rank's part of the sequence (the norms) must be in the plan, so
    that its gradient is summed over the tensor-parallel group. FSDP over ``device_mesh
    ["data_parallel"]`` is left to the strategy.
    """
    tp = device_mesh["tensor_parallel"]
    parallelize_module(
        model,
        tp,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp,
            {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.w1": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def make_data(cfg: Config, samples: int = 256) -> TensorDataset:
    """Sequences counting up modulo a random step: next-token prediction is learnable."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, cfg.vocab_size, (samples, 1), generator=g)
    step = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + step * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return TensorDataset(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", default="2", help='data-parallel groups, or "auto" (the number of nodes)')
    parser.add_argument("--tp", default="auto", help='ranks per tensor-parallel group, or "auto"')
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel group and micro-batch")
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--out", default="tp-checkpoint")
    args = parser.parse_args()
    cfg = Config(dim=args.dim)
    sizes = {k: (v if v == "auto" else int(v)) for k, v in (("dp", args.dp), ("tp", args.tp))}
    strategy = ModelParallelStrategy(
        parallelize, data_parallel_size=sizes["dp"], tensor_parallel_size=sizes["tp"]
    )
    acc = Accelerator(strategy=strategy, precision=args.precision)
    acc.launch()
    acc.seed_everything(0)
    mesh = acc.strategy.device_mesh
    acc.print(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} on {acc.world_size} processes")

    with acc.init_module(empty_init=True):  # no memory until setup; each rank then holds its shard
        model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = acc.setup(model, optimizer)
    loader = acc.setup_dataloaders(DataLoader(make_data(cfg), batch_size=args.batch_size, shuffle=True))

    step, start, batches = 0, time.perf_counter(), iter(loader)
    while step < args.steps:
        for micro in range(args.grad_accum):
            try:
                (tokens,) = next(batches)
            except StopIteration:
                batches = iter(loader)
                (tokens,) = next(batches)
            # ranks of one tensor-parallel group got the same tokens; other groups, other tokens
            with acc.no_backward_sync(model, enabled=micro < args.grad_accum - 1):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
                )
                acc.backward(loss / args.grad_accum)
        norm = acc.clip_gradients(model, optimizer, max_norm=1.0)  # over both meshes
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % 5 == 0 or step == 1:
            acc.print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")
    acc.print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s")

    acc.save(args.out, {"model": model, "optimizer": optimizer, "step": step})  # each rank its shard
    state = {"model": model, "optimizer": optimizer, "step": 0}
    acc.load(args.out, state)
    acc.print(f"saved and loaded {args.out} (step {state['step']}); it loads at any other (dp, tp),")
    acc.print(f"under FSDP or in one process; `minifabric consolidate {args.out} model.pt` makes one file")


if __name__ == "__main__":
    main()
