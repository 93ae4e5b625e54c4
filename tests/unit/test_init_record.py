"""Unit tests of the recording (``minifabric.init.record``) and where it lives (``minifabric.init.attach``).

The record of a model built inside ``meta_init_context`` is held by that model and nothing else:
it reaches ``setup`` with the model, is shared by a copy, follows a part reused in another model,
and dies with the model.
"""

from __future__ import annotations

import copy
import gc
import pkgutil
import weakref
from collections.abc import Callable
from weakref import WeakKeyDictionary, WeakSet

import pytest
import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import minifabric.init
from minifabric.init import materialize, meta_init_context, recorded_places
from minifabric.init.attach import handle_of, module_record, recording_of
from minifabric.init.record import Recorder
from minifabric.init.replay import evaluate, value_of


def _pair(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(eager, meta-built) from the same seed."""
    torch.manual_seed(seed)
    eager = build()
    torch.manual_seed(seed)
    with meta_init_context():
        meta = build()
    return eager, meta


def _equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert not sb[name].is_meta, name
        assert torch.equal(sa[name], sb[name]), name


def test_the_recorder_records_a_random_init_and_replay_gives_its_value() -> None:
    torch.manual_seed(3)
    expected = torch.empty(5, 4)
    torch.nn.init.normal_(expected, std=0.5)
    torch.manual_seed(3)
    with Recorder() as recorder:
        t = torch.empty(5, 4)
        torch.nn.init.normal_(t, std=0.5)
    after = torch.get_rng_state()
    assert t.is_meta
    handle = handle_of(t)
    assert handle is not None and recording_of(t) is recorder.recording
    assert [op.name for op in handle.base.ops] == ["normal_"] and handle.base.ops[0].rng is not None
    assert torch.equal(evaluate(handle.base), expected)
    torch.manual_seed(3)
    torch.empty(5, 4).normal_(std=0.5)
    assert torch.equal(after, torch.get_rng_state())  # the stream advanced as in eager construction


def test_a_view_write_is_recorded_on_the_base() -> None:
    torch.manual_seed(0)
    with Recorder():
        t = torch.empty(3, 4)
        t.data.zero_()
        t[1].fill_(2.0)
        row = t[1]
    expected = torch.zeros(3, 4)
    expected[1] = 2.0
    assert torch.equal(value_of(handle_of(t)), expected)  # type: ignore[arg-type]
    view = handle_of(row)
    assert view is not None and view.base is handle_of(t).base and view.chain  # type: ignore[union-attr]
    assert torch.equal(value_of(view), expected[1])


def test_the_init_package_keeps_no_process_wide_registry() -> None:
    """RECORDS, SEALED and the like are gone: a module-level table would outlive the models it serves."""
    tables = (dict, list, set, WeakIdKeyDictionary, WeakKeyDictionary, weakref.WeakValueDictionary, WeakSet)
    found = []
    for info in pkgutil.iter_modules(minifabric.init.__path__):
        module = __import__(f"minifabric.init.{info.name}", fromlist=["_"])
        for attr, value in vars(module).items():
            if attr.startswith("__") or not isinstance(value, tables):
                continue
            if isinstance(value, (set, dict)) and all(callable(k) or isinstance(k, str) for k in value):
                continue  # constant tables of functions or names (init/calls.py)
            found.append(f"{info.name}.{attr}")
    assert found == []


def test_the_recording_dies_with_the_model() -> None:
    with meta_init_context():
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    recording = weakref.ref(recording_of(model[0].weight))  # type: ignore[arg-type]
    assert recording() is not None
    del model
    gc.collect()
    assert recording() is None
    with meta_init_context():  # another model: its own recording, nothing of the first one
        other = nn.Linear(2, 2)
    assert recording_of(other.weight) is not None
    assert recorded_places(other)


def test_several_models_in_one_block_share_one_recording_and_each_sets_up_alone() -> None:
    def build() -> tuple[nn.Module, nn.Module]:
        return nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5))

    torch.manual_seed(1)
    eager = build()
    torch.manual_seed(1)
    with meta_init_context():
        first, second = build()
    assert recording_of(first.weight) is recording_of(second[0].weight)
    materialize(second)  # in the other order than construction
    materialize(first)
    _equal(eager[0], first)
    _equal(eager[1], second)


def test_a_part_built_in_an_earlier_block_keeps_its_record_in_a_later_model() -> None:
    torch.manual_seed(2)
    encoder_eager = nn.Linear(4, 4)
    head_eager = nn.Linear(4, 2)
    torch.manual_seed(2)
    with meta_init_context():
        encoder = nn.Linear(4, 4)
    with meta_init_context():
        head = nn.Linear(4, 2)
        tied = nn.Linear(4, 4)
        tied.weight = encoder.weight  # a parameter of the earlier block, registered in this one
    model = nn.Sequential(encoder, head)  # a module of the earlier block, reused
    assert recording_of(encoder.weight) is not recording_of(head.weight)
    materialize(model)
    _equal(nn.Sequential(encoder_eager, head_eager), model)
    materialize(tied)
    assert torch.equal(tied.weight, encoder_eager.weight)


def test_new_data_given_in_a_later_block_is_recorded_there() -> None:
    with meta_init_context():
        model = nn.Linear(3, 2)
    first = recording_of(model.weight)
    with meta_init_context():
        model.weight.data = torch.full((2, 3), 1.5)
    assert recording_of(model.weight) is not first
    materialize(model)
    assert torch.equal(model.weight, torch.full((2, 3), 1.5))


def test_a_deepcopy_shares_the_record_and_sets_up_like_the_original() -> None:
    eager, model = _pair(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    copied = copy.deepcopy(model)
    assert module_record(copied[0]) is module_record(model[0])
    assert handle_of(copied[0].weight) is None  # known by its module, by name
    materialize(copied)
    materialize(model)
    _equal(eager, copied)
    _equal(eager, model)


def test_a_write_after_the_block_is_refused_at_setup() -> None:
    with meta_init_context():
        model = nn.Linear(3, 3)
    nn.init.zeros_(model.weight)
    with pytest.raises(ValueError, match=r"'weight' of Linear .*changed in place after"):
        recorded_places(model)


def test_materialize_drops_the_record() -> None:
    with meta_init_context():
        model = nn.Linear(3, 3)
    old = model.weight
    recording = recording_of(old)
    assert recording is not None and old in recording.handles
    materialize(model)
    assert module_record(model) is None and recording_of(model.weight) is None
    assert recording_of(old) is None and old not in recording.handles


def test_a_pickled_meta_parameter_loads_without_a_record() -> None:
    import io

    with meta_init_context():
        model = nn.Linear(3, 2)
    buffer = io.BytesIO()
    torch.save(model.weight, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.is_meta and handle_of(loaded) is None and handle_of(model.weight) is not None


@pytest.mark.parametrize(
    "write",
    [
        lambda copied: nn.init.zeros_(copied[0].weight),
        lambda copied: copied.load_state_dict(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).state_dict()),
    ],
    ids=["init", "load_state_dict"],
)
def test_a_write_after_the_block_to_a_copy_is_refused_at_setup(write: Callable[[nn.Module], None]) -> None:
    """A copy's tensors are known by name only: a write to one after the block is lost on the meta device.

    Setting it up to the original's init would silently drop the write, so ``setup`` refuses it,
    as it does for the original's own tensors; an unwritten copy still sets up to eager values.
    """
    eager, model = _pair(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    copied = copy.deepcopy(model)  # an EMA copy, made after the block
    untouched = copy.deepcopy(model)
    write(copied)
    with pytest.raises(ValueError, match=r"'0\.weight' of Sequential .*changed in place after"):
        recorded_places(copied)
    materialize(untouched)
    _equal(eager, untouched)


def test_a_saved_meta_tensor_loads_with_weights_only() -> None:
    """``torch.load``'s default (``weights_only=True``) loads what was saved before ``setup``, as plain tensors."""
    import io

    with meta_init_context():
        model = nn.Linear(3, 2)
        model.register_buffer("scale", torch.empty(2))
        model.scale.fill_(0.5)
    for saved in (model.weight, model.scale, model.state_dict(keep_vars=True)):
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        for t in loaded.values() if isinstance(loaded, dict) else (loaded,):
            assert t.is_meta and handle_of(t) is None and recording_of(t) is None
    assert handle_of(model.weight) is not None and handle_of(model.scale) is not None


def test_blocks_in_two_threads_that_end_out_of_order_leave_no_hook_behind() -> None:
    """Each thread's block sees only its own models; none is left recording after both ended."""
    import threading

    a_in, b_in, a_out, b_built = (threading.Event() for _ in range(4))
    built: dict[str, nn.Module] = {}

    def first() -> None:
        with meta_init_context():
            a_in.set()
            b_in.wait(30)
        a_out.set()  # ends first, while the other thread's block is still open

    def second() -> None:
        a_in.wait(30)
        with meta_init_context():
            b_in.set()
            a_out.wait(30)
            built["b"] = nn.Linear(3, 3)  # the other block has ended: this one still records
        b_built.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert b_built.is_set()
    assert built["b"].weight.is_meta and handle_of(built["b"].weight) is not None
    assert nn.Linear(2, 2).weight.is_meta is False  # outside any block, after both ended
    torch.manual_seed(0)
    eager = nn.Linear(3, 3)
    torch.manual_seed(0)
    with meta_init_context():
        meta = nn.Linear(3, 3)
    materialize(meta)
    _equal(eager, meta)
