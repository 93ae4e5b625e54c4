"""The fault catalogue: each fault on one rank at one step ends every rank, names the rank, keeps the checkpoint.

Every case runs ``tests/scripts/faults.py`` in a new session (so the test sees, and stops, every
process of the run) under ``minifabric run``, torchrun, ``acc.launch()`` or ranks started by hand
with their variables (``join``: as srun or a pod operator starts them). The faulty step, and the
faulty rank unless the case names it, are drawn at random (seeded by the case, so a failure
reproduces). Rank 0 is stopped under every launch path: under ``acc.launch()`` and ``join`` it hosts
the run's store. Each case checks:

- every process of the run is gone within 10 s of the fault (a silent rank: within the heartbeat
  timeout, here 4 s, plus those 10 s), and the run's exit code is non-zero;
- the first ``[minifabric]`` line names the faulty rank, its host and the cause (for a rank killed
  by a signal: the signal, also under torchrun, where a surviving rank names it);
- the checkpoint committed at step 2 loads, and nothing half-written is left beside it.
"""

from __future__ import annotations

import random
import re
import shlex
import socket
from pathlib import Path

import pytest
import torch

from minifabric import Accelerator
from tests.helpers import PYTHON, REPO, Session, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "tests" / "scripts" / "faults.py")
HEARTBEAT = 4  # seconds (MINIFABRIC_HEARTBEAT_TIMEOUT in the tests; the default is 60)
GONE_SECONDS = 10
START_SECONDS = 150  # start-up of the ranks on a loaded 2-core machine
HOST = socket.gethostname()

#: what the first line says about each fault
CAUSES = {
    "sigkill": r"SIGKILL|ended without a report",
    "sigterm": r"SIGTERM",
    "sigint": r"SIGINT|interrupted",
    "sigsegv": r"SIGSEGV|ended without a report",
    "sigabrt": r"SIGABRT|ended without a report",
    "sigstop": r"is stopped \(SIGSTOP or a debugger\): (sent no heartbeat|the run's store, which it hosts, did"
    r" not answer) for \d+s; killing it",
    "gil": r"sent no heartbeat for \d+s and used no CPU: hung \(e\.g\. in a C call that holds the GIL and waits\);"
    r" killing it",
    "thread": r"failed with RuntimeError in thread 'user-worker': planned failure in a background thread",
    "oom": r"failed with MemoryError",
    "disk": r"failed with CheckpointError: Saving the checkpoint .* failed",
}
SILENT = {"sigstop", "gil"}
#: under torchrun (and ``minifabric run``, torchrun's agent in its process) a rank killed by a signal
#: is named by a survivor, with the signal read from the dead rank's wait status before the agent reaps it
KILLED_BY = {"sigkill": "SIGKILL", "sigsegv": "SIGSEGV", "sigabrt": "SIGABRT"}

#: (launcher, strategy, world, fault, faulty rank: None draws it)
CASES = [
    *[("minifabric-run", "ddp", 2, fault, None) for fault in CAUSES],
    *[("minifabric-run", "fsdp", 2, fault, None) for fault in ("sigkill", "sigsegv", "gil", "thread", "disk")],
    *[("torchrun", "ddp", 2, fault, None) for fault in ("sigkill", "sigstop", "sigsegv", "sigabrt", "oom")],
    ("torchrun", "fsdp", 2, "sigkill", None),
    *[("launch", "fsdp", 2, fault, None) for fault in ("sigkill", "sigterm", "sigint")],
    ("minifabric-run", "fsdp", 4, "sigstop", None),
    *[(launcher, "ddp", 2, "sigstop", 0) for launcher in ("launch", "join", "torchrun", "minifabric-run")],
    ("launch", "ddp", 2, "gil", 0),
]


def _command(launcher: str, world: int, args: list[str]) -> list[str]:
    if launcher == "join":  # every rank started by hand with its variables; the run fails if any rank does
        port = free_port()
        ranks = [
            f"RANK={r} LOCAL_RANK={r} WORLD_SIZE={world} MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
            f" {shlex.join([PYTHON, SCRIPT, *args])} & p{r}=$!"
            for r in range(world)
        ]
        waits = "; ".join(f"wait $p{r} || code=1" for r in range(world))
        return ["sh", "-c", f"{'; '.join(ranks)}; code=0; {waits}; exit $code"]
    if launcher == "minifabric-run":
        port = str(free_port())  # not torchrun's default port: another run on the machine may hold it
        return [PYTHON, "-m", "minifabric", "run", "--devices", str(world), "--main-port", port, SCRIPT, *args]
    if launcher == "torchrun":
        return [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--monitor-interval=0.1",
                "--standalone", SCRIPT, *args]  # fmt: skip
    return [PYTHON, SCRIPT, *args, str(world)]


def _first_report(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("[minifabric]")]
    assert lines, output
    return lines[0]


def _culprit(line: str) -> tuple[int, str]:
    """The rank and host a report line blames: its own, or the one after ``stopped:``."""
    blamed = re.search(r"stopped: rank (\d+) \(host (\S+), pid \d+\)", line)
    if blamed:
        return int(blamed.group(1)), blamed.group(2)
    own = re.match(r"\[minifabric\] (\S+): rank (\d+) ", line)
    assert own, line
    return int(own.group(2)), own.group(1)


def _committed_step(ckpt: Path) -> int:
    acc = Accelerator(accelerator="cpu", devices=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    state = {"model": model, "step": 0}
    acc.load(ckpt, state)
    return state["step"]


def _id(case: tuple) -> str:
    *shape, rank = case
    return "-".join(map(str, shape)) + ("" if rank is None else f"-rank{rank}")


@pytest.mark.parametrize(("launcher", "strategy", "world", "fault", "faulty"), CASES, ids=[_id(c) for c in CASES])
def test_a_fault_on_one_rank_ends_every_rank_and_names_it(tmp_path, launcher, strategy, world, fault, faulty):
    draw = random.Random(f"{launcher}-{strategy}-{world}-{fault}")
    rank, step = draw.randrange(world), draw.randint(3, 5)
    if faulty is not None:
        rank = faulty
    if fault == "disk" and strategy == "ddp":
        rank = 0  # a DDP checkpoint is one file that rank 0 writes: only its disk can fill up
    env = {"MINIFABRIC_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    if launcher == "join":  # ranks started by hand on one machine meet within 5 s unless told otherwise
        env["MINIFABRIC_JOIN_TIMEOUT"] = str(START_SECONDS)
    run = Session(_command(launcher, world, [fault, str(rank), str(step), strategy, str(tmp_path)]), env=env)
    try:
        run.wait_for("FAULT at=", timeout=START_SECONDS)
        fault_at = float(re.search(r"FAULT at=(\S+)", run.output).group(1))
        code, gone = run.finish(timeout=60)
    finally:
        run.kill()  # whatever is left (nothing, when the case passes)
    context = f"rank {rank} at step {step}:\n{run.output}"
    assert code != 0, context
    limit = GONE_SECONDS + (HEARTBEAT if fault in SILENT else 0)
    assert gone - fault_at < limit, context
    first = _first_report(run.output)
    assert re.search(CAUSES[fault], first), context
    if launcher in ("torchrun", "minifabric-run") and fault in KILLED_BY:
        assert f"was killed by {KILLED_BY[fault]}" in first, context
    if fault == "disk":  # every rank fails the save together; the message names the rank it came from
        assert f"rank {rank}: " in first and first.startswith(f"[minifabric] {HOST}: "), context
    else:
        assert _culprit(first) == (rank, HOST), context
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], context  # nothing half-written beside it
    assert _committed_step(tmp_path / "ckpt") == 2, context
