"""What :func:`minifabric.estimate.estimate_memory` is given, resolved: the model, the budget, the 2-D options.

The model may be a factory, its import path or a Hugging Face config; the budget bytes or a string
such as ``"80GiB"``; ``parallelize_fn`` a function or its import path. Each is checked here, with a
message that names the value, before any tracing.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn


def parse_bytes(value: int | str) -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80GB"`` (decimal), ``"512MiB"`` -> bytes."""
    if isinstance(value, int) and value > 0:
        return value
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    try:
        parsed = int(float(number) * units[text[len(number) :]])
    except (ValueError, KeyError):
        parsed = 0
    if parsed <= 0:
        raise ValueError(f"budget={value!r} is not a size: pass bytes or a string like '80GiB' or '24GB'.")
    return parsed


#: builds the model; given a number of blocks, it may build only that many (a config's layer count)
Factory = Callable[[int | None], nn.Module]


def model_factory(model: Any, kwargs: dict[str, Any]) -> Factory:
    """A function that builds the model, from any of the forms ``estimate_memory`` takes."""
    if isinstance(model, str) and not Path(model).exists():
        module_name, sep, attr = model.partition(":")
        if not sep:
            raise ValueError(
                f"model={model!r} is neither a file nor an import path: pass 'pkg.module:make_model' or the"
                " path of a Hugging Face config.json."
            )
        target = getattr(importlib.import_module(module_name), attr)
        return lambda _: target(**kwargs)
    if isinstance(model, (str, Path)) or type(model).__name__.endswith("Config"):
        return _hf_factory(model, kwargs)
    if callable(model):
        return lambda _: model(**kwargs)
    raise TypeError(f"model must be a factory, an import path or a Hugging Face config, got {model!r}.")


def _hf_factory(config: Any, overrides: dict[str, Any]) -> Factory:
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        raise ImportError(
            f"Reading the Hugging Face config {config!r} needs transformers: pip install transformers"
        ) from None
    if not hasattr(config, "to_dict"):
        config = AutoConfig.from_pretrained(str(config))
    for key, value in overrides.items():
        setattr(config, key, value)

    def build(blocks: int | None) -> nn.Module:
        cfg = copy.deepcopy(config)
        cfg.use_cache = False  # training keeps no key/value cache
        if blocks is not None and hasattr(cfg, "num_hidden_layers"):
            cfg.num_hidden_layers = blocks  # building 3 layers of 80 is what takes the time
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            return AutoModel.from_config(cfg)

    return build


def resolve_parallelize_fn(strategy: str, world_size: int, tp: Any, parallelize_fn: Any) -> Any:
    """The ``parallelize_fn`` to trace with (resolved from an import path), or None for 1-D strategies.

    Raises:
        ValueError: 2-D options with another strategy, a ``tensor_parallel_size`` that does not
            divide ``world_size``, or no usable ``parallelize_fn``.
    """
    if strategy != "model_parallel":
        if tp != 1 or parallelize_fn is not None:
            raise ValueError(
                f"tensor_parallel_size={tp!r} and parallelize_fn need strategy='model_parallel', got"
                f" strategy={strategy!r}."
            )
        return None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp!r} must be a positive int dividing world_size={world_size}, e.g."
            " tensor_parallel_size=2 with world_size=4."
        )
    if isinstance(parallelize_fn, str):
        module_name, sep, attr = parallelize_fn.partition(":")
        if not sep:
            raise ValueError(
                f"parallelize_fn={parallelize_fn!r} is not an import path: pass 'pkg.module:parallelize'."
            )
        parallelize_fn = getattr(importlib.import_module(module_name), attr)
    if not callable(parallelize_fn):
        raise ValueError(
            "strategy='model_parallel' needs parallelize_fn: the function ModelParallelStrategy runs,"
            f" or its import path 'pkg.module:parallelize'; got {parallelize_fn!r}."
        )
    return parallelize_fn
