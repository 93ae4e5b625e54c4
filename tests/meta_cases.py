"""Models whose ``__init__`` steps off the common path, for the meta-init exactness tests.

Each builder is called once eagerly and once inside ``init_module(empty_init=True)`` with the same
seed; the set-up model must equal the eager one bitwise, and the random stream afterwards too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


class RareRandom(nn.Module):
    """Random ops that a list of names missed: poisson, gamma, binomial, alpha dropout, multinomial."""

    def __init__(self) -> None:
        super().__init__()
        self.rate = nn.Parameter(torch.empty(6, 5))
        nn.init.uniform_(self.rate, 1.0, 4.0)
        self.counts = nn.Parameter(torch.poisson(self.rate))
        self.gamma = nn.Parameter(torch._standard_gamma(self.rate))
        self.beta = nn.Parameter(
            torch.distributions.Beta(self.rate, self.rate + 1, validate_args=False).sample().contiguous()
        )
        self.binomial = nn.Parameter(torch.binomial(torch.full((6, 5), 7.0), torch.sigmoid(self.rate - 2)))
        self.dropped = nn.Parameter(nn.functional.alpha_dropout(self.rate, 0.5, training=True))
        picks = torch.multinomial(self.rate[0].softmax(0), 4, replacement=True)
        self.picked = nn.Parameter(torch.index_select(self.rate, 1, picks) * 1.0)
        self.after = nn.Linear(5, 3)  # a later init: the stream must be where eager leaves it


def guarded(fn):
    """A wrapper bound in place of a torch.nn.init function, as transformers installs while it inits."""

    def wrapper(tensor, *args, **kwargs):
        if getattr(tensor, "_skip_init", False):
            return tensor
        return fn(tensor, *args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper


class WrappedInit(nn.Module):
    """Init through wrappers of trunc_normal_, orthogonal_, sparse_, dirac_, normal_, kaiming_uniform_."""

    NAMES = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_", "normal_", "kaiming_uniform_")

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 4))
        self.b = nn.Parameter(torch.empty(6, 4))
        self.c = nn.Parameter(torch.empty(6, 4))
        self.d = nn.Parameter(torch.empty(4, 2, 3))
        self.e = nn.Parameter(torch.empty(6, 4))
        self.f = nn.Parameter(torch.empty(6, 4))
        originals = {n: getattr(nn.init, n) for n in self.NAMES}
        try:
            for n, fn in originals.items():
                setattr(nn.init, n, guarded(fn))
            nn.init.trunc_normal_(self.a, std=0.5, a=-0.3, b=0.3)
            nn.init.orthogonal_(self.b)
            nn.init.sparse_(self.c, 0.5)
            nn.init.dirac_(self.d)
            nn.init.normal_(self.e, std=0.1)
            nn.init.kaiming_uniform_(self.f, a=1.0)
        finally:
            for n, fn in originals.items():
                setattr(nn.init, n, fn)
        self.after = nn.Linear(4, 3)


SHARED = np.arange(24, dtype=np.float32).reshape(6, 4)  # an array the init reads, reused afterwards


class ReadsReal(nn.Module):
    """Init that reads real tensors (a numpy array, a tensor) which change after construction."""

    SOURCE = torch.arange(12.0).reshape(3, 4)

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.a.weight.data.copy_(torch.from_numpy(SHARED))
        self.b = nn.Linear(4, 3)
        with torch.no_grad():
            self.b.weight.mul_(self.SOURCE)
            self.b.bias.copy_(self.SOURCE[0, :3])


def change_real_sources() -> None:
    SHARED[:] = -1.0
    ReadsReal.SOURCE.add_(100.0)


class Strided(nn.Module):
    """Random init of channels_last and empty_strided parameters, then ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)
        nn.init.kaiming_normal_(self.conv.weight)
        self.cl = nn.Parameter(torch.empty(4, 3, 2, 2, memory_format=torch.channels_last))
        nn.init.normal_(self.cl)
        self.odd = nn.Parameter(torch.empty_strided((5, 4), (1, 5)))
        nn.init.uniform_(self.odd)
        self.after = nn.Linear(6, 5)


class Spectral(nn.Module):
    """A GAN discriminator's layers: spectral norm with many power iterations at construction."""

    def __init__(self, iterations: int = 15) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 6), n_power_iterations=iterations)
        self.b = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 4), n_power_iterations=iterations)


class OddShapes(nn.Module):
    """Calls that used to fail: an op mixing a meta parameter with a real tensor, a view parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.empty(8, 4))
        nn.init.normal_(self.base)
        scale = torch.linspace(0.5, 2.0, 4)
        self.scaled = nn.Parameter(self.base * scale + torch.ones(8, 1))  # meta op real, out of place
        self.t = nn.Parameter(torch.empty(16, 8).t())  # a parameter created as a view
        nn.init.uniform_(self.t)
        self.probs = nn.Parameter(torch.rand(5))
        self.drawn = nn.Parameter(torch.multinomial(self.probs, 8, replacement=True).float())


CASES = {"rare_random": RareRandom, "wrapped_init": WrappedInit, "strided": Strided, "spectral": Spectral}
CASES["odd_shapes"] = OddShapes
NON_CONTIGUOUS = {"strided", "odd_shapes"}  # parameters FSDP2 cannot shard, however they were built


class SwappedLinear(nn.Linear):
    """A ``Linear`` built on the meta device from another one, taking over its ``Parameter`` objects
    (torchao's ``Float8Linear.from_float``, used by ``convert_to_float8_training``)."""

    @classmethod
    def from_float(cls, mod: nn.Linear) -> SwappedLinear:
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new


class Registers(nn.Module):
    """DINOv3's ViT with its default of no register tokens: a zero-element parameter, never written."""

    def __init__(self, n_storage_tokens: int = 0) -> None:
        super().__init__()
        self.storage_tokens = nn.Parameter(torch.empty(1, n_storage_tokens, 8))
        self.prompts = nn.Parameter(torch.empty(0))  # an optional prompt, off
        self.proj = nn.Linear(8, 8)
        if n_storage_tokens > 0:
            nn.init.normal_(self.storage_tokens, std=0.02)


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)


class FineTune(nn.Module):
    """A pretrained ``backbone`` (loaded with ``assign=True``) under a new ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = nn.Linear(8, 4)


def fine_tune_with_verify(acc: Any) -> tuple[Backbone, FineTune, nn.Module]:
    """``(pretrained backbone, eager FineTune, set-up FineTune)``: built in ``init_module(empty_init=True,
    verify=True)``, the backbone loaded with ``assign=True`` (a real buffer changed, as training does)."""
    torch.manual_seed(5)
    pretrained = Backbone()
    pretrained.norm.running_mean.uniform_()
    torch.manual_seed(6)
    eager = FineTune()
    torch.manual_seed(6)
    with acc.init_module(empty_init=True, verify=True):
        model = FineTune()
    model.backbone.load_state_dict(pretrained.state_dict(), assign=True)
    return pretrained, eager, acc.setup(model)
