"""Meta-device init: build a model without memory, record its init, replay it at ``setup``.

``acc.init_module(empty_init=True)`` enters :func:`meta_init_context`, whose recording is attached
to the models built in it; ``setup`` calls :func:`places_to_materialize` (every meta tensor must
have a replayable record, checked before anything changes) and :func:`materialize` (storage and
eager-construction values, tensor by tensor, each rank keeping only its part of a DTensor). The
pieces, bottom to top:

- :mod:`~minifabric.init.recipe`: the data model (what a tensor's value is made of).
- :mod:`~minifabric.init.attach`: where a recording lives (on the model it built).
- :mod:`~minifabric.init.calls`: how the recorder tells torch calls apart.
- :mod:`~minifabric.init.replay`: computing a value from its recipe.
- :mod:`~minifabric.init.generators`: the random streams a recipe draws from (the CPU's, the build
  device's).
- :mod:`~minifabric.init.record`: the ``TorchFunctionMode`` that records it.
- :mod:`~minifabric.init.draws`: the recorder's real runs of random calls on the build device, and
  the parts it keeps.
- :mod:`~minifabric.init.verify`: the self-check against eager construction.
- :mod:`~minifabric.init.context`: the ``init_module`` context.
- :mod:`~minifabric.init.states`: what ranks compare to agree on one model's random draws.
- the ``setup`` side, one module per stage: :mod:`~minifabric.init.places` (the records, checked),
  :mod:`~minifabric.init.kept` (values kept at construction), :mod:`~minifabric.init.place`
  (storage, and each value where its meta tensor was), :mod:`~minifabric.init.plain_meta` (a model
  built under plain ``torch.device("meta")``: Fabric's ``reset_parameters`` path), and the driver
  :mod:`~minifabric.init.materialize` that picks the mode and runs them in order.

This package imports nothing from ``minifabric.strategies`` or the facade; strategies call it.
"""

from minifabric.init.attach import has_init_records
from minifabric.init.context import (
    following_init_records,
    keeping_init_records,
    meta_init_context,
    paused_recording,
)
from minifabric.init.materialize import materialize, places_to_materialize
from minifabric.init.places import Place, has_meta_tensors, recorded_places
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
    "places_to_materialize",
    "recorded_places",
    "reset_meta_modules",
    "self_check",
    "verify_requested",
    "wants_check",
]
