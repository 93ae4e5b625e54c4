"""ModelParallelStrategy and HSDP options are validated at construction, the mesh sizes at `Accelerator(...)`."""

from __future__ import annotations

import pytest

from minifabric import Accelerator, FSDPStrategy, ModelParallelStrategy
from minifabric.strategies import ModelParallelStrategy as FromStrategies
from minifabric.strategies.model_parallel_checks import resolve_sizes


def _fn(model, mesh):
    return model


def test_importable_from_both_places_with_fabric_defaults() -> None:
    assert FromStrategies is ModelParallelStrategy
    strategy = ModelParallelStrategy(_fn)
    assert (strategy.data_parallel_size, strategy.tensor_parallel_size) == ("auto", "auto")
    assert strategy.state_dict_type == "sharded"
    assert ModelParallelStrategy(_fn, save_distributed_checkpoint=False).state_dict_type == "full"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"parallelize_fn": "parallelize"}, TypeError, "parallelize_fn must be a function"),
        ({"parallelize_fn": _fn, "data_parallel_size": 0}, ValueError, "data_parallel_size=0"),
        ({"parallelize_fn": _fn, "tensor_parallel_size": "2"}, ValueError, "tensor_parallel_size='2'"),
        (
            {"parallelize_fn": _fn, "save_distributed_checkpoint": "yes"},
            TypeError,
            "save_distributed_checkpoint",
        ),
        (
            {"parallelize_fn": _fn, "activation_checkpointing_policy": {"Block"}},
            TypeError,
            "set of nn.Module",
        ),
    ],
)
def test_bad_options_raise_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ModelParallelStrategy(**kwargs)


def test_sizes_auto_and_mismatch() -> None:
    assert resolve_sizes("auto", "auto", 2, 4) == (2, 4)  # Fabric: dp = nodes, tp = devices per node
    assert resolve_sizes(2, "auto", 1, 8) == (2, 4)
    assert resolve_sizes("auto", 2, 1, 8) == (4, 2)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size='auto'.*world size 8"):
        resolve_sizes(3, "auto", 1, 8)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 .*world size 1"):
        Accelerator(accelerator="cpu", strategy=ModelParallelStrategy(_fn, 2, 2), devices=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_mesh": (2,)}, r"must be \(replicas, shards\)"),
        ({"device_mesh": (0, 2)}, r"must be \(replicas, shards\)"),
        ({"device_mesh": (2, 2)}, 'sharding_strategy="HYBRID_SHARD", device_mesh=\\(2, 2\\)'),
    ],
)
def test_hsdp_device_mesh_is_validated(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        FSDPStrategy(**kwargs)
    assert FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=[2, 2]).device_mesh == (2, 2)
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\) holds 4 ranks, but the run has 1"):
        Accelerator(
            accelerator="cpu",
            strategy=FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)),
            devices=1,
        )
