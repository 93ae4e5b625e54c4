"""Lightning Fabric's tensor-parallel example (its model, `parallelize` with TP + FSDP2 + torch's
`checkpoint_wrapper`, and loop with `loss_parallel`), re-typed small with only the import changed,
trains on 4 CPU processes; its checkpoint loads into one process and a model without the wrapper."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from minifabric import Accelerator
from tests.helpers import REPO, run_command

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "tests" / "scripts" / "fabric_tp_example.py"


def test_fabric_example_trains_and_its_checkpoint_loads(tmp_path):
    result = run_command([sys.executable, str(SCRIPT), str(tmp_path)], timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "Training successfully completed!" in result.stdout
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)  # 32 samples / 2 dp groups / batch 4

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from fabric_tp_example import ModelArgs, Transformer
    finally:
        sys.path.remove(str(SCRIPT.parent))
    model = Transformer(ModelArgs())  # no tensor parallel, no FSDP, no checkpoint_wrapper
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    acc = Accelerator(accelerator="cpu", devices=1)
    model, optimizer = acc.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "iteration": -1}
    acc.load(tmp_path / "checkpoint.pt", state)
    assert state["iteration"] == 3
    assert len(optimizer.state) == len(list(model.parameters()))  # moments matched by name, prefix-free
    assert all(torch.isfinite(p).all() for p in model.parameters())
