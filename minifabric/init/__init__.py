"""Meta-device init: build a model without memory, record its init, replay it at ``setup``.

``acc.init_module(empty_init=True)`` enters :func:`meta_init_context`; ``setup`` calls
:func:`recorded_places` (every meta tensor must have a replayable record, checked before anything
changes) and :func:`materialize` (storage and eager-construction values, tensor by tensor, each
rank keeping only its part of a DTensor). The pieces, bottom to top:

- :mod:`~minifabric.init.recipe`: the data model (what a tensor's value is made of).
- :mod:`~minifabric.init.record`: the ``TorchFunctionMode`` that records it.
- :mod:`~minifabric.init.replay`: computing a value from its recipe.
- :mod:`~minifabric.init.context`: the ``init_module`` context.
- :mod:`~minifabric.init.materialize`: the ``setup`` side, for plain tensors and DTensors alike.
- :mod:`~minifabric.init.plain_meta`: a model built under plain ``torch.device("meta")`` (no record).
- :mod:`~minifabric.init.verify`: the self-check against eager construction.

This package imports nothing from ``minifabric.strategies`` or the facade; strategies call it.
"""

from minifabric.init.context import (
    following_init_records,
    keeping_init_records,
    meta_init_context,
    paused_recording,
)
from minifabric.init.materialize import (
    Place,
    has_init_records,
    has_meta_tensors,
    materialize,
    recorded_places,
)
from minifabric.init.plain_meta import reset_meta_modules
from minifabric.init.verify import InitMismatch, self_check, verify_requested, wants_check

__all__ = [
    "InitMismatch",
    "Place",
    "following_init_records",
    "has_init_records",
    "has_meta_tensors",
    "keeping_init_records",
    "materialize",
    "meta_init_context",
    "paused_recording",
    "recorded_places",
    "reset_meta_modules",
    "self_check",
    "verify_requested",
    "wants_check",
]
