"""Tiny models shared by the tests: a GPT-style transformer with an optionally tied output layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tied: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Embedding, ``n_layer`` identical blocks, final norm, output layer (tied to the embedding)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or GPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight
        # a real buffer built in __init__: must survive meta-device init
        self.register_buffer("positions", torch.arange(cfg.block_size), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a batch of token ids of shape (B, T+1)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def token_batches(steps: int, batch_size: int, cfg: GPTConfig, seed: int = 1234) -> torch.Tensor:
    """Deterministic random token batches of shape (steps, batch_size, block_size + 1)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (steps, batch_size, cfg.block_size + 1), generator=generator)


class NoInit(nn.Module):
    """A module with a parameter that ``__init__`` never initializes (eager leaves it uninitialized)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x @ self.weight)


def gpt_optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """AdamW with two groups (decay on matrices, none on vectors) to check that groups survive setup."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def micro_batches(
    batch: torch.Tensor, world_size: int, rank: int, accumulate: int
) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s micro-batches of a global batch: its contiguous slice, cut into ``accumulate`` parts."""
    return batch.chunk(world_size)[rank].chunk(accumulate)


def reference_training(
    state: dict[str, torch.Tensor],
    cfg: GPTConfig,
    batches: torch.Tensor,
    world_size: int,
    accumulate: int,
    max_norm: float,
) -> tuple[list[list[float]], list[float], dict[str, torch.Tensor]]:
    """Train a plain single-process GPT on the same global batches as ``world_size`` data-parallel ranks.

    Each step averages the ranks' micro-batch losses (what data-parallel gradient averaging computes),
    accumulates ``accumulate`` micro-batches, clips and steps AdamW (:func:`gpt_optimizer`).

    Returns:
        per-step per-rank losses, per-step gradient norms, final state dict.
    """
    model = GPT(cfg)
    model.load_state_dict(state)
    optimizer = gpt_optimizer(model)
    losses, norms = [], []
    for batch in batches:
        step_losses = [0.0] * world_size
        for i in range(accumulate):
            per_rank = [
                gpt_loss(model, micro_batches(batch, world_size, r, accumulate)[i]) for r in range(world_size)
            ]
            (torch.stack(per_rank).mean() / accumulate).backward()
            for r, loss in enumerate(per_rank):
                step_losses[r] += loss.item() / accumulate
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_losses)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
