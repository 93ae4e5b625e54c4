"""``fabric run`` and ``minifabric run`` with a script that never calls ``launch()``.

Under Fabric's CLI the ``Fabric()`` constructor joins the process group, so the script's own
``torch.distributed`` calls work at once; ``Accelerator()`` under ``minifabric run`` does the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, Session, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = REPO / "tests" / "scripts" / "cli_join.py"
COMMANDS = {"lightning": "fabric", "minifabric": "minifabric"}


def _run(library: str, out: Path) -> list[dict]:
    out.mkdir()
    command = str(Path(sys.executable).parent / COMMANDS[library])
    args = ["run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(free_port())]
    run = Session([command, *args, str(SCRIPT), library, str(out)])
    code, _ = run.finish(timeout=200)  # kills the whole session (every rank) on a timeout
    assert code == 0, f"{library}:\n{run.output[-3000:]}"
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


def test_the_constructor_joins_the_process_group_under_the_cli(tmp_path):
    lightning = _run("lightning", tmp_path / "lightning")
    mini = _run("minifabric", tmp_path / "minifabric")
    assert mini == lightning == [{"initialized": True, "world": 2, "sum": 3.0}] * 2
