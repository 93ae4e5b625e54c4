"""Starting a script's processes: ``python script.py``, ``acc.launch(fn)``, ``minifabric run``, torchrun.

Each test runs ``tests/scripts/train.py`` in a new session (process group), so the test can check
that no process of the run is left behind. Failures are timed from the moment the failing rank
raises (it prints a timestamp) to the moment the last process of the run is gone: start-up on a
busy 2-core machine is slow and says nothing about failing fast.
"""

import re
import subprocess

import pytest

from tests.helpers import PYTHON, REPO, Session, command_env, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "tests" / "scripts" / "train.py")
FAIL_FAST_SECONDS = 10


def _commands(port: int) -> dict[str, list[str]]:
    return {
        "script": [PYTHON, SCRIPT, "--devices", "2"],
        "spawn": [PYTHON, SCRIPT, "--devices", "2", "--spawn"],
        "minifabric run": [PYTHON, "-m", "minifabric", "run", "--devices", "2", "--main-port", str(port), SCRIPT],
        "torchrun": [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                     SCRIPT, "--devices", "2"],
    }  # fmt: skip


def _run(cmd: list[str], timeout: float = 120, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` in a new session; return exit code, output, and when its last process was gone."""
    run = Session(cmd, env)
    code, gone = run.finish(timeout)
    return code, run.output, gone


def _results(output: str) -> dict[int, tuple[int, str]]:
    """rank -> (world size, parameter checksum) from the script's RESULT lines."""
    found = re.findall(r"RESULT rank=(\d) world=(\d) node=\d params=(-?[\d.]+)", output)
    return {int(rank): (int(world), params) for rank, world, params in found}


@pytest.mark.parametrize("how", ["script", "minifabric run", "torchrun"])
def test_the_same_script_trains_however_it_is_started(how):
    code, output, _ = _run(_commands(free_port())[how])
    assert code == 0, output
    results = _results(output)
    assert sorted(results) == [0, 1], output
    assert results[0] == results[1]  # world of 2, identical parameters on both ranks
    assert results[0][0] == 2


@pytest.mark.parametrize("how", ["script", "spawn", "torchrun"])
def test_an_exception_on_one_rank_ends_every_rank_fast(how):
    cmd = [*_commands(free_port())[how], "--steps", "50", "--fail-rank", "1", "--fail-step", "3"]
    code, output, ended = _run(cmd)
    assert code != 0, output
    failed_at = float(re.search(r"FAILING at=(\S+)", output).group(1))
    assert ended - failed_at < FAIL_FAST_SECONDS, output
    assert "rank 1" in output  # the failing rank is named ...
    assert (
        "Traceback" in output and "RuntimeError: planned failure at step 3" in output
    )  # ... with its traceback
    assert "RESULT" not in output


def test_two_simulated_nodes_form_one_world():
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "minifabric",
                "run",
                "--num-nodes",
                "2",
                "--node-rank",
                str(node),
                "--devices",
                "1",
                "--main-address",
                "127.0.0.1",
                "--main-port",
                str(port),
                SCRIPT,
            ],
            env=command_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=150)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                subprocess.run(["kill", "-9", f"-{node.pid}"], check=False)
                node.communicate()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    results = [_results(output) for output in outputs]
    assert list(results[0]) == [0] and list(results[1]) == [1]  # one rank per node
    assert results[0][0] == results[1][1]  # world of 2, identical parameters
    assert results[0][0][0] == 2
    assert "node=0" in outputs[0] and "node=1" in outputs[1]


_IDLE_SCRIPT = """
import os, sys, time
from minifabric import Accelerator

acc = Accelerator(accelerator="cpu", devices=2)
acc.launch()
print(f"PID rank={acc.global_rank} pid={os.getpid()}", flush=True)
if acc.global_rank == int(sys.argv[1]):
    time.sleep(1.0)
    print(f"FAILING at={time.time()}", flush=True)
    raise RuntimeError("planned failure outside any collective")
time.sleep(60)  # the other rank is in no collective: only the launcher can end it
"""


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_the_script_launcher_ends_ranks_that_wait_in_no_collective(tmp_path, failing_rank):
    script = tmp_path / "idle.py"
    script.write_text(_IDLE_SCRIPT)
    code, output, ended = _run([PYTHON, str(script), str(failing_rank)], timeout=90)
    assert code != 0, output
    failed_at = float(re.search(r"FAILING at=(\S+)", output).group(1))
    assert ended - failed_at < FAIL_FAST_SECONDS, output
    assert f"rank {failing_rank} failed with RuntimeError: planned failure" in output, output
