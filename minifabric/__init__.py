"""minifabric: your own PyTorch training loop on one device, data-parallel, or fully sharded (FSDP2)."""

from minifabric._torch import check_torch_version

check_torch_version()

from minifabric.accelerator import Accelerator  # noqa: E402
from minifabric.checkpoint.errors import CheckpointError  # noqa: E402
from minifabric.precision import MixedPrecision, Precision, TruePrecision  # noqa: E402
from minifabric.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy, wrap  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "DDPStrategy",
    "FSDPStrategy",
    "MixedPrecision",
    "Precision",
    "SingleDeviceStrategy",
    "Strategy",
    "TruePrecision",
    "wrap",
]
