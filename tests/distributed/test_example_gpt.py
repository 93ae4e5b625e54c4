"""examples/gpt/train.py in a tiny configuration on 2 processes: it trains, and a resumed run is bit-exact.

One uninterrupted run of 6 steps is compared with a run stopped after step 3 (``--stop-at 3``,
which saves an asynchronous sharded checkpoint) and continued with ``--resume``: every logged
training loss and the final validation loss must be equal as floats, not merely close.
"""

from __future__ import annotations

import json
import sys

import pytest

from minifabric import latest_checkpoint
from tests.helpers import REPO, run_command

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "examples" / "gpt" / "train.py"
TINY = [
    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
    "--batch-size", "4", "--grad-accum", "2", "--max-steps", "6", "--warmup-steps", "2",
    "--eval-interval", "3", "--ckpt-interval", "3", "--data-bytes", "60000", "--sample-bytes", "20",
]  # fmt: skip


def _run(out_dir, *extra):
    result = run_command([sys.executable, str(SCRIPT), *TINY, "--out-dir", str(out_dir), *extra], timeout=120)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result.stdout


def test_tiny_run_and_bit_exact_resume(tmp_path):
    straight = _run(tmp_path / "straight")
    assert (
        "unigram baseline (val)" in straight
        and "final val loss" in straight
        and "---- sample ----" in straight
    )
    assert "[minifabric] rank" not in straight

    first = _run(tmp_path / "resumed", "--stop-at", "3")
    assert "stopping at step 3" in first
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step-000003"  # committed, sharded
    second = _run(tmp_path / "resumed", "--resume")
    assert "resumed from" in second and "at step 3" in second
    assert "done: 6 steps" in straight and "done: 3 steps" in second  # the steps each run made
    assert "final val loss" in second and "on all" in second  # says what the final validation covers

    a = json.loads((tmp_path / "straight" / "log.json").read_text())
    b = json.loads((tmp_path / "resumed" / "log.json").read_text())
    assert [h[0] for h in b["history"]] == [1, 2, 3, 4, 5, 6]
    assert b["history"] == a["history"]  # every step's train loss (and val loss), bit for bit
    assert b["final_val_loss"] == a["final_val_loss"]
