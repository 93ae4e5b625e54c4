"""``should_stop`` outside a Ray Train worker: unchanged, and ray is never imported for it.

Inside a worker it also follows Ray's preemption notice (``tests/distributed/test_ray_preemption.py``).
"""

import importlib.util
import subprocess

import pytest

from tests.helpers import PYTHON, command_env

_OUTSIDE_RAY = """
import sys
from minifabric import Accelerator
from minifabric.runtime.ray import preemption_reader
acc = Accelerator(accelerator="cpu")
acc.launch()
print("STOP", acc.should_stop, acc.should_stop, acc.strategy.rank._preempted)
print("READER", preemption_reader())
print("RAY", sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
"""

_RAY_DRIVER = """
import ray.train
from minifabric import Accelerator
from minifabric.runtime.ray import preemption_reader
acc = Accelerator(accelerator="cpu")
acc.launch()
print("V2", hasattr(ray.train, "get_preemption_info"))
print("READER", preemption_reader())
print("STOP", acc.should_stop)
"""


def _run(code: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [PYTHON, "-c", code], env=command_env(env), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_outside_ray_should_stop_reads_no_preemption_notice_and_imports_no_ray():
    out = _run(_OUTSIDE_RAY)
    assert "STOP False False None" in out, out
    assert "READER None" in out, out
    assert "RAY []" in out, out


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
@pytest.mark.parametrize("v2", ["1", "0"])
def test_a_process_that_imported_ray_train_but_is_no_worker_reads_no_notice(v2):
    # the driver of a Ray job (Ray answers get_context() with RuntimeError), and Ray Train v1 (no
    # get_preemption_info at all): should_stop stays local
    out = _run(_RAY_DRIVER, {"RAY_TRAIN_V2_ENABLED": v2})
    assert f"V2 {v2 == '1'}" in out, out
    assert "READER None" in out, out
    assert "STOP False" in out, out
