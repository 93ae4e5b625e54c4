"""The GPU card's CPU dry run (``benchmarks/bench_gpu.py --tiny``) runs every phase and writes every field."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import PYTHON, REPO, run_command

pytestmark = pytest.mark.slow

LOOP = ("step_s", "tokens_per_s", "mfu", "peak_memory_bytes")
ASYNC = ("blocking_s", "extra_step_s", "steps_overlapped", "wait_s", "lost_s", "lost_over_sync_save")
FIELDS = {
    "step_eager": {"minifabric_over_fsdp2_by_hand": ("median", "per_round"), "minifabric": LOOP, "fsdp2_by_hand": LOOP},
    "step_compiled": {"minifabric_over_fsdp2_by_hand": ("median", "per_round"), "minifabric": LOOP, "fsdp2_by_hand": LOOP},
    "single": {"minifabric_over_autocast_by_hand": ("median", "per_round"), "minifabric": LOOP, "autocast_by_hand": LOOP},
    "init": {
        "minifabric_meta_over_torchtitan_pattern": ("median", "per_round"),
        "minifabric_meta_over_eager_then_setup": ("median", "per_round"),
        "median_s": ("minifabric_meta", "torchtitan_pattern", "eager_then_setup"),
    },
    "checkpoint": {
        "save_gb_per_s": ("minifabric", "raw_dcp"),
        "load_gb_per_s": ("minifabric", "raw_dcp"),
        "async_first": ASYNC,
        "async_steady": ASYNC,
    },
}  # fmt: skip
DIFFERENCES = ("extra_step_s", "lost_s", "lost_over_sync_save")
RATIOS = {
    "checkpoint": ("save_minifabric_over_raw_dcp_rate", "load_minifabric_over_raw_dcp_rate", "sync_save_s", "state_bytes"),
}


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(900)
def test_tiny_dry_run_runs_every_phase_and_writes_every_field(tmp_path):
    out = tmp_path / "card.json"
    cmd = [PYTHON, str(REPO / "benchmarks" / "bench_gpu.py"), "--tiny", "--out", str(out), "--dir", str(tmp_path / "ckpt")]
    result = run_command(cmd, timeout=840)
    assert result.returncode == 0, result.stdout + result.stderr
    card = json.loads(out.read_text())
    assert card["tiny"] is True and card["device"] == "cpu"
    assert card["memory_note"] == "n/a on CPU"
    assert _positive(card["flops_per_token"]) and _positive(card["model"]["params"])
    for phase, groups in FIELDS.items():
        assert "error" not in card[phase], card[phase]
        for group, keys in groups.items():
            for key in keys:
                value = card[phase][group][key]
                if key == "peak_memory_bytes":
                    assert value is None  # n/a on CPU
                elif key == "per_round":
                    assert value and all(_positive(v) for v in value)
                elif key in DIFFERENCES:  # steps overlapping the save may be faster than the median step
                    assert isinstance(value, float) and math.isfinite(value), (phase, group, key, value)
                else:
                    assert _positive(value), (phase, group, key, value)
    for phase, keys in RATIOS.items():
        assert all(_positive(card[phase][key]) for key in keys)
    assert card["checkpoint"]["async_first"]["steps_overlapped"] >= 2
    for phase in FIELDS:  # the table names every phase, none failed or skipped
        assert phase in result.stdout
    assert "FAILED" not in result.stdout and "not run" not in result.stdout
