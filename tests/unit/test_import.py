"""``import minifabric`` stays cheap: heavy pieces are imported only when a run needs them."""

import subprocess

from tests.helpers import PYTHON, command_env

_CHECK = """
import sys
import minifabric
heavy = [m for m in ("lightning_fabric", "torch.distributed.fsdp", "torch.distributed.tensor") if m in sys.modules]
print("HEAVY", heavy)
from minifabric import FSDPStrategy  # still importable, on first use
print("FSDP", FSDPStrategy.__module__, "torch.distributed.fsdp" in sys.modules)
"""


def test_import_pulls_in_neither_lightning_fabric_nor_fsdp():
    out = subprocess.run(
        [PYTHON, "-c", _CHECK], env=command_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout
    assert "FSDP minifabric.strategies.fsdp True" in out.stdout, out.stdout
