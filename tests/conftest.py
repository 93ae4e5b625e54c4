import os
import signal

import pytest
import torch.distributed as dist

# A shell that starts a command in the background (`cmd &` without job control) starts it with
# SIGINT ignored, and an ignored signal stays ignored in every process it execs: the rank
# processes of the Ctrl-C tests would then never see their SIGINT. Ranks get the interpreter's
# usual Ctrl-C handling, however the suite was started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts and ends with the same environment and no process group."""
    before = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(before)
