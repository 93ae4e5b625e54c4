"""Property test: random small models, assembled from a pool of layers and init styles, built inside
``init_module(empty_init=True)`` set up bitwise equal to eager construction with the same seed.

CI runs a fixed number of models from a fixed seed; ``MINIFABRIC_PROPERTY_BUDGET=N`` runs N models
(and ``MINIFABRIC_PROPERTY_SEED`` picks another seed).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from torch import nn

from minifabric import Accelerator
from tests.init_styles import mismatches

BUDGET = int(os.environ.get("MINIFABRIC_PROPERTY_BUDGET", "12"))
SEED = int(os.environ.get("MINIFABRIC_PROPERTY_SEED", "2024"))
LAYERS = ("linear", "embedding", "layernorm", "conv1d", "bilinear", "custom", "weight_norm", "spectral_norm")
STYLES = ("reset", "apply", "nn_init", "data_write", "buffer", "tie")


class Custom(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))
        self.s = nn.Parameter(torch.ones(n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.w, a=math.sqrt(5))


def _layer(kind: str, n: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(n, n)
    if kind == "embedding":
        return nn.Embedding(n, n)
    if kind == "layernorm":
        return nn.LayerNorm(n)
    if kind == "conv1d":
        return nn.Conv1d(n, n, 3)
    if kind == "bilinear":
        return nn.Bilinear(n, n, n)
    if kind == "custom":
        return Custom(n)
    if kind == "weight_norm":
        return nn.utils.parametrizations.weight_norm(nn.Linear(n, n))
    return nn.utils.parametrizations.spectral_norm(nn.Linear(n, n), n_power_iterations=2)


class RandomModel(nn.Module):
    """A stack of layers from ``spec``, then the init styles ``spec`` lists, in order."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        n = spec["n"]
        self.layers = nn.ModuleList(_layer(kind, n) for kind in spec["layers"])
        for style, arg in spec["styles"]:
            getattr(self, f"_style_{style}")(arg, n)

    def _targets(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if "parametrizations" not in name]

    def _style_reset(self, arg: int, n: int) -> None:
        layer = self.layers[arg % len(self.layers)]
        for sub in layer.modules():
            if hasattr(sub, "reset_parameters") and not nn.utils.parametrize.is_parametrized(sub):
                sub.reset_parameters()

    def _style_apply(self, arg: int, n: int) -> None:
        def init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear) and not nn.utils.parametrize.is_parametrized(module):
                module.weight.data.normal_(mean=0.0, std=0.02 * (arg + 1))
                if module.bias is not None:
                    module.bias.data.zero_()
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.5)
                module.weight.data[arg % n].zero_()

        self.apply(init)

    def _style_nn_init(self, arg: int, n: int) -> None:
        targets = [p for p in self._targets() if p.dim() >= 2]
        if not targets:
            return
        p = targets[arg % len(targets)]
        fn = (nn.init.xavier_uniform_, nn.init.trunc_normal_, nn.init.orthogonal_, nn.init.kaiming_normal_)
        fn[arg % len(fn)](p)

    def _style_data_write(self, arg: int, n: int) -> None:
        targets = self._targets()
        p = targets[arg % len(targets)]
        with torch.no_grad():
            p.data.mul_(0.5).add_(torch.randn(p.shape) * 0.1)
            p.data.view(-1)[: max(1, p.numel() // 3)].fill_(arg * 0.25)

    def _style_buffer(self, arg: int, n: int) -> None:
        self.register_buffer(f"table{arg}", torch.arange(n, dtype=torch.float32) / (arg + 1))
        empty = torch.empty(n)
        self.register_buffer(f"filled{arg}", empty)
        with torch.no_grad():
            empty.copy_(torch.linspace(0, 1, n) * (arg + 2))

    def _style_tie(self, arg: int, n: int) -> None:
        square = [
            m for m in self.layers if isinstance(m, (nn.Linear, nn.Embedding)) and "weight" in m._parameters
        ]
        if len(square) >= 2:
            square[0].weight = square[-1].weight


def _spec(rng: random.Random) -> dict:
    return {
        "n": rng.choice([3, 4, 6]),
        "layers": [rng.choice(LAYERS) for _ in range(rng.randint(1, 4))],
        "styles": [(rng.choice(STYLES), rng.randint(0, 5)) for _ in range(rng.randint(1, 5))],
    }


SPECS = [_spec(random.Random(SEED + i)) for i in range(BUDGET)]


@pytest.mark.parametrize("spec", SPECS, ids=[f"model{i}" for i in range(len(SPECS))])
def test_random_models_equal_eager_construction(spec: dict) -> None:
    acc = Accelerator(accelerator="cpu", devices=1)
    acc.launch()
    torch.manual_seed(3)
    eager = RandomModel(spec)
    stream = torch.rand(8)
    torch.manual_seed(3)
    with acc.init_module(empty_init=True):
        model = RandomModel(spec)
    assert torch.equal(torch.rand(8), stream), f"random stream differs for {spec}"
    assert mismatches(eager, acc.setup(model)) == [], spec
