"""One Fabric script, run on lightning-fabric and on minifabric (only its import differs): the same numbers.

tests/scripts/fabric_script.py trains on 2 CPU processes with "ddp", using loggers, callbacks, a
routed ``training_step``, shuffled distributed data, clipping, in-place ``all_reduce`` and lightning's
``ThroughputMonitor``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import PYTHON, REPO, Session

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = REPO / "tests" / "scripts" / "fabric_script.py"


def _csv(out: Path) -> list[dict]:
    with open(out / "logs" / "run" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_lightning_fabric_and_minifabric_give_the_same_numbers(tmp_path):
    outs = {name: tmp_path / name for name in ("lightning", "minifabric")}
    runs = {name: Session([PYTHON, str(SCRIPT), name, str(out)]) for name, out in outs.items()}
    try:
        codes = {name: run.finish(timeout=240)[0] for name, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()  # every rank of both sessions, whatever happened
    for name, run in runs.items():
        assert codes[name] == 0, f"{name}:\n{run.output[-3000:]}"

    lightning, mini = (json.loads((outs[n] / "result.json").read_text()) for n in ("lightning", "minifabric"))
    assert len(mini["losses"]) == 8
    assert mini["losses"] == pytest.approx(lightning["losses"], rel=1e-6, abs=1e-7)
    for name, values in lightning["weights"].items():
        assert mini["weights"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name
    assert mini["throughput"] == pytest.approx(lightning["throughput"])
    # each logger wrote one file, from rank 0, with the same rows
    for out in outs.values():
        assert [p.name for p in (out / "logs" / "run").iterdir()] == ["version_0"]
    rows = {name: _csv(out) for name, out in outs.items()}
    assert [r["step"] for r in rows["minifabric"]] == [r["step"] for r in rows["lightning"]]
    assert [float(r["loss"]) for r in rows["minifabric"] if r["loss"]] == pytest.approx(
        [float(r["loss"]) for r in rows["lightning"] if r["loss"]], rel=1e-6
    )
