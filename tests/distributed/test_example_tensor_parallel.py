"""examples/tensor_parallel.py on 4 CPU processes through `minifabric run`, then its sharded
checkpoint consolidated to one file that a plain module loads."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from tests.helpers import REPO, free_port, run_command

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "examples" / "tensor_parallel.py"


def test_example_trains_and_consolidates(tmp_path):
    ckpt = tmp_path / "ckpt"
    port = str(free_port())  # not torchrun's default port: another run on the machine may hold it
    command = [sys.executable, "-m", "minifabric", "run", "--devices", "4", "--main-port", port, str(SCRIPT), "--steps", "10"]
    result = run_command([*command, "--out", str(ckpt)], timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "mesh (2, 2) ('data_parallel', 'tensor_parallel') on 4 processes" in result.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # steps 1, 5, 10
    assert "saved and loaded" in result.stdout

    out = tmp_path / "model.pt"
    result = run_command(
        [sys.executable, "-m", "minifabric", "consolidate", str(ckpt), str(out)], timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclass looks itself up there
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules[spec.name]
    model = example.Transformer(example.Config())
    consolidated = torch.load(out, weights_only=True)
    model.load_state_dict(consolidated["state"]["model"])  # strict: every key, every shape
