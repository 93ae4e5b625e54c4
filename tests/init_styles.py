"""Models that initialize their weights the ways real model code does, for the meta-init tests.

- :class:`NanoGPTStyle`: ``self.apply(self._init_weights)`` in ``__init__`` with ``nn.init.normal_`` /
  ``zeros_`` and a scaled init of the residual projections (nanoGPT, minGPT).
- :class:`HFStyle`: Hugging Face's ``_init_weights`` with ``module.weight.data.normal_()``, an
  embedding padding row zeroed through a view, ``fill_`` and a ``trunc_normal_``.
- :class:`ResetStyle`: modules with ``reset_parameters()`` called from ``__init__``, a rotary table
  as a buffer (persistent and not) recomputed by ``reset_parameters()``, a parameter created with
  ``torch.ones`` and one with ``torch.randn``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


class NanoGPTStyle(GPT):
    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "out.weight")):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


class HFStyle(GPT):
    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.weight.data[0].zero_()  # a padding row
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
            torch.nn.init.trunc_normal_(module.weight, mean=1.0, std=0.02, a=0.9, b=1.1)


class Rotary(nn.Module):
    """Only state: inverse frequencies, a buffer computed in ``__init__`` and by ``reset_parameters()``."""

    def __init__(self, dim: int, persistent: bool) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=persistent)
        self.register_buffer("computed", self._frequencies(), persistent=persistent)
        self.reset_parameters()

    def _frequencies(self) -> torch.Tensor:
        return 1.0 / (10000.0 ** (torch.arange(0, self.dim, 2).float() / self.dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(self._frequencies())


class ScaledLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.scale = nn.Parameter(torch.ones(n_out))
        self.shift = nn.Parameter(torch.randn(n_out) * 0.1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.xavier_normal_(self.weight[: self.weight.shape[0] // 2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale + self.shift


class ResetStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG.vocab_size, 16)
        self.rope = Rotary(16, persistent=False)
        self.rope_saved = Rotary(16, persistent=True)
        self.blocks = nn.ModuleList(ScaledLinear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, CFG.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * self.rope.inv_freq.repeat(2) * self.rope_saved.computed.repeat(2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


STYLES = {"nanogpt": NanoGPTStyle, "hf": HFStyle, "reset": ResetStyle}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (persistent or not) as full CPU tensors (sharded ones gathered)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name.removeprefix("_forward_module.").removeprefix("module.")] = t.detach().cpu().clone()
    return out


def mismatches(expected: nn.Module, actual: nn.Module) -> list[str]:
    """Names whose values differ (bitwise) between two models, or that only one of them has."""
    a, b = full_state(expected), full_state(actual)
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def kept_parts_against_dense(
    device: str, parts: int, dtype: torch.dtype = torch.float32, large: bool = False
) -> list[str]:
    """Build a model under meta init as each of ``parts`` ranks would (``keep=(parts, rank)``) on
    ``device``; compare every kept part with the same rows of eager construction on ``device``.

    Returns the differences, as ``"rank r: name"`` (and ``"rank r: stream"`` when the device's
    generator after construction is not where eager construction leaves it). Uneven sizes (rows not
    divisible by ``parts``) and an init of several rounds of random numbers are included; ``large``
    adds layers of many rounds of a GPU's random kernels (ranks draw their rows of those alone).
    """
    from minifabric.init import meta_init_context
    from minifabric.init.attach import handle_of

    def build() -> nn.Module:
        model = nn.Sequential(
            nn.Embedding(1000, 37, dtype=dtype), nn.Linear(37, 203, dtype=dtype), nn.Linear(203, 5, dtype=dtype)
        )
        nn.init.trunc_normal_(model[1].weight, std=0.02)
        if large:  # 4099 x 2048 (kaiming_uniform_) and 32000 x 512 (normal_): rows uneven at 2, 3 and 8
            model.append(nn.Sequential(nn.Linear(2048, 4099, dtype=dtype), nn.Embedding(32000, 512, dtype=dtype)))
        return model

    def stream() -> torch.Tensor:
        return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()

    torch.manual_seed(0)
    with torch.device(device):
        eager = build()
    eager_stream = stream()
    wrong = []
    for rank in range(parts):
        torch.manual_seed(0)
        with torch.device(device), meta_init_context(keep=(parts, rank), device=device):
            model = build()
        if not torch.equal(stream(), eager_stream):
            wrong.append(f"rank {rank}: stream")
        compared = 0
        for (name, p), want in zip(model.named_parameters(), eager.parameters(), strict=True):
            kept = handle_of(p).base.kept
            if kept is None:
                continue  # replayed at setup (a later op made the kept part stale)
            compared += 1
            (n, r), part = kept
            chunks = want.detach().chunk(parts, 0)
            expected = chunks[rank] if rank < len(chunks) else want.detach()[:0]
            if (n, r) != (parts, rank) or part.device.type != device or not torch.equal(part, expected):
                wrong.append(f"rank {rank}: {name}")
        if compared < 3:  # the embedding and both weights draw first: each keeps its part
            wrong.append(f"rank {rank}: only {compared} kept parts")
    return wrong
