"""Lightning Fabric's ``DDPStrategy(start_method=...)`` and DDP keyword arguments, read at construction."""

from __future__ import annotations

import pytest

from minifabric import Accelerator, DDPStrategy


def test_spawn_start_method_needs_a_function_as_in_fabric() -> None:
    acc = Accelerator(accelerator="cpu", devices=1, strategy=DDPStrategy(start_method="spawn"))
    with pytest.raises(TypeError, match=r"acc.launch\(train\)"):
        acc.launch()
    assert acc.launch(lambda a: a.world_size) == 1


def test_popen_start_method_is_the_default_launch() -> None:
    acc = Accelerator(accelerator="cpu", devices=1, strategy=DDPStrategy(start_method="popen"))
    acc.launch()
    assert acc.world_size == 1


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"start_method": "fork"}, ValueError, "does not fork"),
    ({"start_method": "threads"}, ValueError, "Unknown start_method='threads'"),
    ({"static_grap": True}, TypeError, "'static_grap'"),
    ({"device_ids": [0]}, TypeError, "Accelerator\\(devices=...\\)"),
])  # fmt: skip
def test_bad_ddp_arguments_raise_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DDPStrategy(**kwargs)
