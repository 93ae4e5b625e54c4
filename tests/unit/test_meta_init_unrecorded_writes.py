"""Meta init of writes made by calls that are not in-place methods (``out=``, ``torch._foreach_*_``,
``inplace=True``): into a real tensor they happen as in eager construction; into a tracked one they
are refused at ``setup``, also where the value written reaches a parameter only later, through
other tensors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minifabric.init import materialize, meta_init_context
from tests.init_styles import mismatches


class Writes(nn.Module):
    """A drawn weight, a real buffer, and ``write(self)`` at the end of ``__init__``."""

    def __init__(self, write: Callable[[nn.Module], None]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))
        nn.init.normal_(self.w)
        self.register_buffer("buf", torch.zeros(4, 3))
        with torch.no_grad():
            write(self)


def _foreach_copy_into_buffer(m: nn.Module) -> None:
    torch._foreach_copy_([m.buf], [m.w])


def _out_into_buffer(m: nn.Module) -> None:
    torch.mul(m.w, 2, out=m.buf)


@pytest.mark.parametrize("write", [_foreach_copy_into_buffer, _out_into_buffer])
def test_a_write_into_a_real_tensor_from_a_tracked_value_is_made_as_in_eager_construction(write: Callable) -> None:
    """Before, the real buffer kept its zeros: the call ran on a meta copy of it."""
    eager, model = _eager_and_meta(write)
    materialize(model)
    assert mismatches(eager, model) == []


def _eager_and_meta(write: Callable) -> tuple[nn.Module, nn.Module]:
    """``Writes(write)`` built eagerly and under meta init, from the same seed."""
    torch.manual_seed(0)
    eager = Writes(write)
    torch.manual_seed(0)
    with meta_init_context():
        return eager, Writes(write)


def _dropout_of_an_intermediate(m: nn.Module) -> None:
    h = m.w * 2
    F.dropout(h, 0.5, training=True, inplace=True)
    m.w.copy_(h)


def _foreach_then_derived(m: nn.Module) -> None:
    h = m.w * 2
    torch._foreach_mul_([h], 3.0)
    m.w.copy_(h + 1)


def _foreach_then_data(m: nn.Module) -> None:
    h = m.w.detach().clone()
    torch._foreach_add_([h], 1.0)
    m.w.data = h


@pytest.mark.parametrize("write", [_dropout_of_an_intermediate, _foreach_then_derived, _foreach_then_data])
def test_an_unrecorded_write_into_an_intermediate_that_reaches_a_parameter_is_refused(write: Callable) -> None:
    """Before, ``setup`` gave the weight computed without the write, silently."""
    eager, model = _eager_and_meta(write)
    try:
        materialize(model)
    except ValueError as e:
        assert "parameter 'w'" in str(e) and "writes into it unrecorded" in str(e)
        return
    pytest.fail(f"set up without the write; differs from eager construction in {mismatches(eager, model)}")
