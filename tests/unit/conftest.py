import pytest

from minifabric import Accelerator


@pytest.fixture
def acc() -> Accelerator:
    """A launched single-process CPU Accelerator."""
    accelerator = Accelerator(accelerator="cpu")
    accelerator.launch()
    return accelerator
