"""minifabric: your own PyTorch training loop on one device, data-parallel, or fully sharded (FSDP2)."""

from typing import TYPE_CHECKING, Any

from minifabric._torch import check_torch_version

check_torch_version()

from minifabric.accelerator import Accelerator  # noqa: E402
from minifabric.checkpoint.errors import CheckpointError  # noqa: E402
from minifabric.checkpoint.periodic import latest_checkpoint  # noqa: E402
from minifabric.precision import MixedPrecision, Precision, TruePrecision  # noqa: E402
from minifabric.seed import seed_everything  # noqa: E402
from minifabric.strategies import DDPStrategy, SingleDeviceStrategy, Strategy, wrap  # noqa: E402
from minifabric.strategies.ft.config import FaultTolerance  # noqa: E402

if TYPE_CHECKING:
    from minifabric.checkpoint.hf import export_safetensors
    from minifabric.estimate import estimate_memory
    from minifabric.strategies.fsdp import FSDPStrategy
    from minifabric.strategies.model_parallel import ModelParallelStrategy

__version__ = "0.1.0"


__all__ = [
    "Accelerator",
    "CheckpointError",
    "DDPStrategy",
    "FSDPStrategy",
    "FaultTolerance",
    "MixedPrecision",
    "ModelParallelStrategy",
    "Precision",
    "SingleDeviceStrategy",
    "Strategy",
    "TruePrecision",
    "estimate_memory",
    "export_safetensors",
    "latest_checkpoint",
    "seed_everything",
    "wrap",
]


def __getattr__(name: str) -> Any:
    # FSDP (and torch's DTensor) is imported on first use: see minifabric.strategies
    if name in ("FSDPStrategy", "ModelParallelStrategy"):
        from minifabric import strategies

        return getattr(strategies, name)
    if name == "estimate_memory":
        from minifabric.estimate import estimate_memory

        return estimate_memory
    # torch's distributed checkpointing too
    if name == "export_safetensors":
        from minifabric.checkpoint.hf import export_safetensors

        return export_safetensors
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
