"""How a 2-rank run ends: an early exit, a failure while the others wait, Ctrl-C, SIGTERM, a hang.

Every case runs ``tests/scripts/lifecycle.py`` in a new session so the test sees every process of
the run, and times the end from the moment the failing rank acts (it prints a timestamp) or the
signal is sent: start-up on a busy 2-core machine is slow and says nothing about ending fast.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from minifabric import latest_checkpoint
from tests.helpers import PYTHON, REPO, Session, live_processes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "tests" / "scripts" / "lifecycle.py")
GONE_SECONDS = 10  # every process of the run gone this long after the failure
START_SECONDS = 120  # start-up of two ranks on a loaded machine


def _failed_at(output: str) -> float:
    return float(re.search(r"FAILING at=(\S+)", output).group(1))


def test_sys_exit_on_rank_zero_ends_every_rank_with_its_code(tmp_path):
    run = Session([PYTHON, SCRIPT, "exit"], env={"LIFECYCLE_OUT": str(tmp_path)})
    code, gone = run.finish(timeout=START_SECONDS)
    assert code == 3, run.output
    assert gone - _failed_at(run.output) < GONE_SECONDS, run.output
    assert "rank 0 exited with code 3: stopping every rank" in run.output


def test_an_exception_inside_rank_zero_first_releases_the_others_with_the_news(tmp_path):
    run = Session([PYTHON, SCRIPT, "first"], env={"LIFECYCLE_OUT": str(tmp_path)})
    code, gone = run.finish(timeout=START_SECONDS)
    assert code != 0, run.output
    assert gone - _failed_at(run.output) < GONE_SECONDS, run.output
    assert run.output.count("Traceback") == 1, run.output  # rank 0's, once ...
    assert "rank 0 failed with RuntimeError: planned failure while preparing data" in run.output
    assert (
        "rank 1 stopped: rank 0 failed inside `acc.rank_zero_first()`" in run.output
    )  # ... one line on rank 1
    assert "runpy" not in run.output  # the launcher's own frames are not shown


def test_launch_fn_returns_a_large_result(tmp_path):
    run = Session([PYTHON, SCRIPT, "big", "--spawn"], env={"LIFECYCLE_OUT": str(tmp_path)})
    code, _ = run.finish(timeout=START_SECONDS)
    assert code == 0, run.output
    assert f"RESULT {1 << 20}" in run.output


def test_sigterm_to_the_parent_of_launch_fn_ends_every_rank(tmp_path):
    run = Session([PYTHON, SCRIPT, "train", "--spawn"], env={"LIFECYCLE_OUT": str(tmp_path)})
    run.wait_for("STEP 3", timeout=START_SECONDS)
    sent = time.time()
    os.kill(run.proc.pid, signal.SIGTERM)
    code, gone = run.finish(timeout=60)
    assert code != 0, run.output
    assert gone - sent < GONE_SECONDS, run.output
    assert "killed by SIGTERM" in run.output


def test_ranks_die_with_a_killed_launcher(tmp_path):
    run = Session([PYTHON, SCRIPT, "train"], env={"LIFECYCLE_OUT": str(tmp_path)})
    run.wait_for("STEP 3", timeout=START_SECONDS)
    sent = time.time()
    os.kill(run.proc.pid, signal.SIGKILL)  # no chance to clean up: the kernel ends the ranks
    _, gone = run.finish(timeout=60)
    assert gone - sent < GONE_SECONDS, run.output


def test_ctrl_c_ends_the_run_with_130_and_one_line(tmp_path):
    run = Session([PYTHON, SCRIPT, "loop"], env={"LIFECYCLE_OUT": str(tmp_path)})
    run.wait_for("STEP 4", timeout=START_SECONDS)
    before = len(run.lines)
    sent = time.time()
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal does
    code, gone = run.finish(timeout=60)
    assert code == 130, run.output
    assert gone - sent < 5 + 1, run.output  # (1 s of polling slack on a loaded machine)
    after = [line for _, line in run.lines[before:] if not line.startswith("STEP")]
    assert len(after) <= 3, run.output
    message = [line for line in after if "interrupted" in line]
    assert len(message) == 1, run.output
    assert re.search(
        rf"interrupted at step \d+; last committed checkpoint: {re.escape(str(tmp_path))}/ckpt", message[0]
    )


def test_a_hang_prints_every_ranks_stack_and_ends_the_run(tmp_path):
    run = Session([PYTHON, SCRIPT, "spin"], env={"LIFECYCLE_OUT": str(tmp_path), "MINIFABRIC_TIMEOUT": "3"})
    code, gone = run.finish(timeout=START_SECONDS)
    assert code != 0, run.output
    assert gone - _failed_at(run.output) < 3 + GONE_SECONDS, run.output
    assert "rank 0 waited 3s in all_reduce" in run.output
    assert "rank 1 was here when rank 0 waited 3s in all_reduce" in run.output
    assert re.search(r"\[rank 1\] .*while True", run.output) or "[rank 1]   File" in run.output, run.output
    assert "[rank 0]   File" in run.output


@pytest.mark.parametrize("busy", ["0", "1", "both"])
def test_a_rank_at_work_in_one_long_c_call_that_holds_the_gil_is_not_killed(tmp_path, busy):
    # rank 0 also hosts the run's store; the peer beats for the busy rank, seeing its CPU time advance
    # ("both": the rank that ends its call first could not look meanwhile, and must not judge by then)
    env = {"LIFECYCLE_OUT": str(tmp_path), "MINIFABRIC_HEARTBEAT_TIMEOUT": "2"}
    run = Session([PYTHON, SCRIPT, f"busy-{busy}"], env=env)
    code, _ = run.finish(timeout=START_SECONDS)
    for rank in (0, 1) if busy == "both" else (int(busy),):
        assert re.search(rf"HELD \S+s rank={rank}$", run.output, re.M), run.output  # three heartbeat timeouts
    assert code == 0, run.output
    for rank in (0, 1):
        assert f"DONE rank={rank}" in run.output, run.output
    assert "[minifabric]" not in run.output, run.output


def test_a_good_exit_with_rank_zero_ending_first_is_quiet(tmp_path):
    # rank 0 hosts the store and leaves before rank 1 ends: rank 1 must not call the store after that
    env = {"LIFECYCLE_OUT": str(tmp_path), "MINIFABRIC_HEARTBEAT_TIMEOUT": "2"}  # 10 beats a second
    run = Session([PYTHON, SCRIPT, "late"], env=env)
    code, _ = run.finish(timeout=START_SECONDS)
    assert code == 0, run.output
    shown = [line for _, line in run.lines if line and not re.match(r"(PID|STEP|DONE) ", line)]
    assert shown == [], run.output  # no TCPStore warning, no C++ frame, nothing at all
    for rank in (0, 1):
        assert f"DONE rank={rank}" in run.output, run.output


EXAMPLE = str(REPO / "examples" / "gpt" / "train.py")
TINY_GPT = [
    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
    "--grad-accum", "1", "--max-steps", "8", "--warmup-steps", "2", "--eval-interval", "100",
    "--ckpt-interval", "100", "--data-bytes", "60000", "--sample-bytes", "0",
]  # fmt: skip


def _rank_pid(session: Session, rank: int) -> int:
    """The pid of a rank started by the launcher of ``session`` (from its LOCAL_RANK)."""
    for pid in live_processes(session.proc.pid):
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in environ and pid != session.proc.pid:
            return pid
    raise AssertionError(f"no rank {rank} among {live_processes(session.proc.pid)}:\n{session.output}")


def test_preempting_one_rank_of_the_example_saves_at_a_step_and_resumes_bit_exactly(tmp_path):
    straight = Session([PYTHON, EXAMPLE, *TINY_GPT, "--out-dir", str(tmp_path / "straight")])
    assert straight.finish(timeout=START_SECONDS)[0] == 0, straight.output

    out = tmp_path / "preempted"
    run = Session([PYTHON, EXAMPLE, *TINY_GPT, "--out-dir", str(out)])
    run.wait_for("step 2/8", timeout=START_SECONDS)
    os.kill(_rank_pid(run, 1), signal.SIGTERM)  # what a scheduler preempting one task does
    code, _ = run.finish(timeout=START_SECONDS)
    assert code == 0, run.output
    stopped = int(re.search(r"stopping at step (\d+); continue with --resume", run.output).group(1))
    assert 2 <= stopped < 8, run.output
    assert latest_checkpoint(out / "checkpoints").name == f"step-{stopped:06d}"  # committed

    resumed = Session([PYTHON, EXAMPLE, *TINY_GPT, "--out-dir", str(out), "--resume"])
    assert resumed.finish(timeout=START_SECONDS)[0] == 0, resumed.output
    assert f"at step {stopped}" in resumed.output
    a = json.loads((tmp_path / "straight" / "log.json").read_text())
    b = json.loads((out / "log.json").read_text())
    assert b["history"] == a["history"]  # every step's loss, bit for bit
    assert b["final_val_loss"] == a["final_val_loss"]
