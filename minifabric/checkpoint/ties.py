"""Tied weights: state-dict names that hold one shared parameter (e.g. GPT-2's embedding and output head).

``module.state_dict()`` lists a tied parameter under every name; safetensors stores it once. The name
kept is the one Hugging Face ``transformers`` keeps: not a target of any ``_tied_weights_keys``
mapping (``{"lm_head.weight": "transformer.wte.weight"}`` keeps ``transformer.wte.weight``), else the
first in state-dict order (the name under which the parameter was registered first).
"""

from __future__ import annotations

from torch import nn

from minifabric.parameters import shared_tensors


def _tie_targets(module: nn.Module) -> set[str]:
    targets = set()
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None)
        if isinstance(declared, dict):
            targets |= {f"{prefix}.{name}" if prefix else name for name in declared}
    return targets


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Groups of state-dict names that share one parameter or buffer, the name to keep first.

    Example:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 2), "head": torch.nn.Linear(2, 4)})
        >>> m.head.weight = m.emb.weight
        >>> tied_groups(m)
        [['emb.weight', 'head.weight']]
    """
    order = {name: i for i, name in enumerate(module.state_dict())}
    targets = _tie_targets(module)
    groups = []
    for places in shared_tensors(module, buffers=True):
        names = [place.name for place in places if place.name in order]
        if len(set(names)) > 1:
            unique = sorted(set(names), key=lambda n: (n in targets, order[n]))
            groups.append(unique)
    return groups
