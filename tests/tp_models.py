"""A tiny transformer with odd per-rank sizes and its tensor-parallel plan (Colwise/Rowwise + sequence-parallel norms).

Sizes: width 36 with 4 heads of 9, MLP width 100, vocabulary 40, so at tp = 2 or 4 the local
shards have odd sizes (9 rows, 25 columns, ...). The embedding is sharded by the plan along the
vocabulary; a per-channel scale is left to FSDP alone, so a model mixes parameters on the 2-D
mesh and on the data-parallel mesh only. It is applied before the sequence is split, as every
parameter outside the plan must be: on a rank's part of the sequence its gradient would be partial,
and nothing would sum it over the tensor-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TPConfig:
    vocab_size: int = 40
    seq_len: int = 8
    dim: int = 36
    n_head: int = 4
    hidden: int = 100
    n_layer: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism each rank holds some of the heads: count them from the local width.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TPBlock(nn.Module):
    def __init__(self, cfg: TPConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TPTransformer(nn.Module):
    def __init__(self, cfg: TPConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TPConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(TPBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, cfg.dim))  # left to FSDP alone

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) * self.scale  # whole sequence: `scale` is not in the plan
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def parallelize(model: TPTransformer, device_mesh: object) -> TPTransformer:
    """The tensor-parallel plan: torchtitan's layout (sequence-parallel norms, Colwise in, Rowwise out)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh = device_mesh["tensor_parallel"]  # type: ignore[index]
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # the residual stream is split along the sequence from the first block on
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
            tp_mesh,
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


def tp_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on token ids of shape (B, T + 1)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def tp_batches(steps: int, batch_size: int, cfg: TPConfig, seed: int = 99) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (steps, batch_size, cfg.seq_len + 1), generator=generator)


def tp_optimizer(model: nn.Module) -> torch.optim.AdamW:
    # Adam divides by sqrt(v) + eps: for a weight whose gradient cancels to ~1e-8 (there are some),
    # a 1e-10 difference from another summation order (4 ranks reduce in another order than one
    # process) becomes a 1e-5 difference in its step with the default eps. eps=1e-4 bounds that
    # amplification (lr / eps) to 100, so the comparison at 1e-6 tests the layout, not the rounding.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
