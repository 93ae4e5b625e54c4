"""Engines that start the processes themselves: torchrun with restarts, Kubeflow, SLURM, a user's group.

The training script (``tests/scripts/elastic.py``) saves every 2 steps and resumes from the newest
committed checkpoint; every run of it prints each rank's weights as bytes, so runs started by
different engines are compared bitwise with one uninterrupted torchrun run. A broken environment
must end every process within 10 s of its ``Accelerator()`` call, naming the variable (the time
before it, importing torch, is not the library's and takes 20 s on this 2-core machine when shared).
"""

from __future__ import annotations

import re
import socket
import time

import pytest
import torch
import torch.distributed as dist

from minifabric import Accelerator
from tests.helpers import PYTHON, REPO, Session, free_port, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "tests" / "scripts" / "elastic.py")
FAIL_SECONDS = 10


def _torchrun(port: int, ckpt, *extra: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            *extra, SCRIPT, "--ckpt", str(ckpt)]  # fmt: skip


def _results(output: str) -> dict[int, dict[str, str]]:
    found = re.finditer(r"RESULT rank=(\d) world=(\d) attempt=(\d) resumed=(\d+) weights=([0-9a-f]+)", output)
    return {int(m[1]): {"world": m[2], "attempt": m[3], "resumed": m[4], "weights": m[5]} for m in found}


def _run(cmd: list[str], env: dict | None = None, timeout: float = 150) -> tuple[int, str]:
    session = Session(cmd, env)
    code, _ = session.finish(timeout)
    return code, session.output


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The weights of an uninterrupted 2-rank torchrun run (the same on both ranks)."""
    code, output = _run(_torchrun(free_port(), tmp_path_factory.mktemp("reference")))
    results = _results(output)
    assert code == 0 and sorted(results) == [0, 1], output
    assert results[0]["weights"] == results[1]["weights"]
    return results[0]["weights"]


# A rank's first line of failure: a traceback, or minifabric's report ("[minifabric] host: rank 1 stopped: ...").
_FAILURE_LINE = re.compile(r"Traceback|\[minifabric\] (\S+: )?rank")


def _several(commands: list[tuple[list[str], dict]], timeout: float = 120) -> list[tuple[int, str, float]]:
    """Start every command at once; return (code, output, seconds from its START line to its error).

    The process ends right after its error (``Session.finish`` fails if any process is left).
    """
    sessions = [Session(cmd, env) for cmd, env in commands]
    ended = []
    try:
        for session in sessions:
            code, _ = session.finish(timeout)
            started = next((t for t, line in session.lines if line.startswith("START at=")), None)
            failed = next((t for t, line in session.lines if _FAILURE_LINE.match(line)), None)
            seconds = failed - started if started is not None and failed is not None else float("inf")
            ended.append((code, session.output, seconds))
    finally:
        for session in sessions:
            session.kill()
    return ended


def test_torchrun_restart_resumes_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(
    tmp_path, reference
):
    code, output = _run(_torchrun(free_port(), tmp_path, "--max-restarts", "1") + ["--kill-step", "4"])
    assert code == 0, output
    assert "KILLED rank=1 step=4" in output
    results = _results(output)
    assert sorted(results) == [0, 1], output
    for rank in (0, 1):
        assert results[rank]["attempt"] == "1"  # the second attempt finished the job ...
        assert results[rank]["resumed"] == "4"  # ... from the checkpoint of step 4
        assert results[rank]["weights"] == reference  # bitwise equal to the run without failure


def _pod_env(rank: int, world_size: int, port: int, **extra: str) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "RANK": str(rank), **extra}  # fmt: skip


def test_kubeflow_pods_form_one_world(tmp_path, reference):
    """One process per pod, as a PyTorchJob starts them: no LOCAL_RANK."""
    port = free_port()
    runs = _several([([PYTHON, SCRIPT, "--ckpt", str(tmp_path)], _pod_env(r, 2, port)) for r in (0, 1)])
    for code, output, _ in runs:
        assert code == 0, output
    results = {**_results(runs[0][1]), **_results(runs[1][1])}
    assert sorted(results) == [0, 1]
    assert all(r["world"] == "2" and r["weights"] == reference for r in results.values())


def test_torchrun_in_a_pod_reads_the_pet_variables(tmp_path, reference):
    """Kubeflow's torchrun-in-pod: the job sets PET_* and the container runs plain ``torchrun script``."""
    pet = {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_NODE_RANK": "0",
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}  # fmt: skip
    code, output = _run([PYTHON, "-m", "torch.distributed.run", SCRIPT, "--ckpt", str(tmp_path)], pet)
    assert code == 0, output
    results = _results(output)
    assert sorted(results) == [0, 1] and all(r["weights"] == reference for r in results.values())


def _slurm_port() -> tuple[str, int]:
    """A SLURM job id whose derived port (10000 + its last 4 digits) is free now."""
    for job_id in range(4321, 9999, 97):
        port = 10000 + job_id
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job_id), port
    raise RuntimeError("no free port for a simulated SLURM job")


def _slurm_env(rank: int, job_id: str, **extra: str) -> dict:
    return {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "train",
            "SLURM_JOB_ID": job_id, "SLURM_NODELIST": "localhost", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", **extra}  # fmt: skip


def test_srun_tasks_form_one_world(tmp_path, reference):
    """Two tasks as ``srun --ntasks=2`` starts them on one node."""
    job_id, _ = _slurm_port()
    runs = _several([([PYTHON, SCRIPT, "--ckpt", str(tmp_path)], _slurm_env(r, job_id)) for r in (0, 1)])
    for code, output, _ in runs:
        assert code == 0, output
    results = {**_results(runs[0][1]), **_results(runs[1][1])}
    assert sorted(results) == [0, 1] and all(r["weights"] == reference for r in results.values())


def _port_env(port: int) -> dict:
    return {"MASTER_PORT": str(port)}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("world size larger than the processes", r"WORLD_SIZE=3, but rank\(s\) \[2\] did not arrive"),
        ("rank outside the world", r"RANK=2 is outside the world of WORLD_SIZE=2"),
        ("address that does not resolve", r"MASTER_ADDR='no-such-host.invalid' does not resolve"),
        ("SLURM job without a node list", r"SLURM_NODELIST is not set"),
    ],
)
def test_a_broken_environment_fails_fast_naming_the_variable(tmp_path, case, message):
    port = free_port()
    cmd = [PYTHON, SCRIPT, "--ckpt", str(tmp_path)]
    if case == "world size larger than the processes":
        envs = [_pod_env(r, 3, port) for r in (0, 1)]
    elif case == "rank outside the world":
        envs = [_pod_env(r, 2, port) for r in (0, 2)]
    elif case == "address that does not resolve":
        envs = [_pod_env(r, 2, port, MASTER_ADDR="no-such-host.invalid") for r in (0, 1)]
    else:
        job_id, _ = _slurm_port()
        envs = [{k: v for k, v in _slurm_env(r, job_id).items() if k != "SLURM_NODELIST"} for r in (0, 1)]
    runs = _several([(cmd, env) for env in envs])
    assert any(re.search(message, output) for _, output, _ in runs), runs[0][1] + runs[1][1]
    for code, output, seconds in runs:
        assert code != 0, output  # every process fails ...
        assert seconds < FAIL_SECONDS, (seconds, output)  # ... within 10 s of Accelerator()
        assert "RESULT" not in output


def _adopt(rank: int, port: int) -> tuple[int, int, bool, float]:
    import os

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    total = acc.all_reduce(torch.tensor([float(rank + 1)]), reduce_op="sum")
    return acc.global_rank, acc.world_size, dist.group.WORLD is group, float(total)


def test_a_process_group_created_before_the_accelerator_is_adopted():
    port = free_port()
    results = run_distributed(_adopt, 2, port)
    assert results == [(0, 2, True, 3.0), (1, 2, True, 3.0)]


def test_a_rank_that_cannot_reach_rank_0_fails_fast(tmp_path):
    """Rank 1 alone (rank 0 never started): it names the address and port it tried."""
    started = time.time()
    runs = _several([([PYTHON, SCRIPT, "--ckpt", str(tmp_path)], _pod_env(1, 2, free_port()))])
    code, output, seconds = runs[0]
    assert code != 0 and "could not reach rank 0 at MASTER_ADDR=127.0.0.1" in output, output
    assert seconds < FAIL_SECONDS, (seconds, time.time() - started)
