import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts and ends with the same environment and no process group."""
    before = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(before)
