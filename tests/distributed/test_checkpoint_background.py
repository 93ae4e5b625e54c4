"""A background (asynchronous) save that fails is never silent, on every rank, within seconds.

Each case runs ``tests/scripts/async_save_failure.py``: the last rank's shard write fails (disk
full) or its CPU copy fails (host memory exhausted).
"""

import json
import re
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, free_port, run_command

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = str(REPO / "tests" / "scripts" / "async_save_failure.py")
ENV = {"MINIFABRIC_TIMEOUT": "120"}  # a hang would show as a wait of two minutes


def _nothing_left(out: Path) -> None:
    ckpt = out / "ckpt"
    left = sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else []
    assert not left, left
    assert not list(out.glob(".ckpt*")), list(out.glob(".ckpt*"))


@pytest.mark.parametrize(
    ("launcher", "devices"), [("python", 2), ("python", 1), ("minifabric-run", 2)]
)
@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("write_at_exit", "OSError: [Errno 28] No space left on device"),
        ("copy_at_exit", "MemoryError: host memory exhausted while copying"),
    ],
)
def test_a_failed_background_save_at_the_end_of_a_script_fails_the_run_on_every_rank(
    tmp_path: Path, mode: str, cause: str, launcher: str, devices: int
) -> None:
    # `minifabric run` runs on torchrun, whose agent reported a failed rank with a traceback and a
    # table of about 40 lines; the ranks' own lines say it all
    # a port of its own: torchrun's default one may be taken by another run on the machine
    minifabric_run = [PYTHON, "-m", "minifabric", "run", "--devices", str(devices), "--main-port", str(free_port())]
    run = minifabric_run if launcher != "python" else [PYTHON]
    done = run_command([*run, SCRIPT, mode, str(tmp_path), str(devices)], timeout=240, env=ENV)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    for rank in range(devices):
        lines = [
            line
            for line in output.splitlines()
            if line.startswith(f"[minifabric] rank {rank}: the asynchronous")
        ]
        assert len(lines) == 1, output
        assert (
            f"rank {devices - 1}: {cause}" in lines[0]
            and "previous checkpoint at that path is intact" in lines[0]
        )
    assert "Traceback" not in output and "gloo" not in output.lower(), output  # one line, no traceback
    if launcher == "minifabric-run":
        assert "minifabric run: rank " in output and "ChildFailedError" not in output, output
        assert len(output.strip().splitlines()) <= devices + 3, output
    _nothing_left(tmp_path)


def test_a_failed_cpu_copy_raises_the_same_error_on_every_rank_within_seconds(tmp_path: Path) -> None:
    done = run_command([PYTHON, SCRIPT, "copy", str(tmp_path)], timeout=240, env=ENV)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    results = sorted(
        (json.loads(m) for m in re.findall(r"^RESULT (.*)$", output, re.M)), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in results] == [0, 1], output
    assert results[0]["error"] == results[1]["error"], results
    assert results[0]["error"].startswith("CheckpointError: Saving the checkpoint"), results
    assert "rank 1: MemoryError: host memory exhausted while copying" in results[0]["error"], results
    assert all(r["seconds"] < 60 for r in results), results  # not the collective timeout
    _nothing_left(tmp_path)
