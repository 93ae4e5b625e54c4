"""Per-step fault tolerance on torchft: 2 replica groups x 2 FSDP ranks, one group killed and restarted.

The test starts a lighthouse in this process and each group as its own ``acc.launch()`` run
(``tests/scripts/ft_group.py``), SIGKILLs one group's processes in the middle of training, checks
that the other group keeps committing steps alone, restarts the killed group, and checks that it
heals from the live group (no checkpoint on disk is read) and that both end with the same weights.
The run is then replayed in this process from the recorded participation (which group's batch went
into which committed step): the weights equal that replay. Everything started is stopped in a
``finally``, also when an assertion fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO

if importlib.util.find_spec("torchft") is None:
    pytest.skip(
        "per-step fault tolerance needs torchft: pip install 'minifabric[ft]'", allow_module_level=True
    )

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = REPO / "tests" / "scripts" / "ft_group.py"
STEPS, KILL_AT, HOLD_AT = 16, 4, 9


class Job:
    """The processes of a test job: start, watch their output, kill, and stop them all."""

    def __init__(self, out: Path, lighthouse: str) -> None:
        self.out = out
        self.lighthouse = lighthouse
        self.lines: queue.Queue[str] = queue.Queue()
        self.transcript: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.start_time = time.monotonic()

    def start(self, group: int, *extra: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}
        env.pop("MASTER_PORT", None)
        command = [sys.executable, str(SCRIPT), "--group", str(group), "--lighthouse", self.lighthouse]
        command += ["--out", str(self.out), "--steps", str(STEPS), *extra]
        process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: the launcher and both ranks
        )
        self.processes.append(process)
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()
        return process

    def _pump(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.put(line.rstrip())

    def mark(self) -> int:
        """A point in the output: ``wait_for(..., since=mark)`` looks only at lines after it."""
        return len(self.transcript)

    def wait_for(self, pattern: str, timeout: float = 180, since: int = 0) -> None:
        """Wait until a line after ``since`` matches ``pattern`` (lines already read count too)."""
        if any(re.search(pattern, line) for line in self.transcript[since:]):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                failed = [p.returncode for p in self.processes if p.poll() not in (None, 0, -signal.SIGKILL)]
                if failed:
                    raise AssertionError(
                        f"a group failed (exit {failed}). Output:\n" + self.output()
                    ) from None
                continue
            self.transcript.append(line)
            if re.search(pattern, line):
                return
        raise AssertionError(f"no line matched {pattern!r} in {timeout} s. Output:\n" + self.output())

    def output(self) -> str:
        while not self.lines.empty():
            self.transcript.append(self.lines.get())
        return "\n".join(self.transcript[-200:])

    @staticmethod
    def kill(process: subprocess.Popen) -> None:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait(timeout=30)

    def stop_all(self) -> None:
        for process in self.processes:
            self.kill(process)


def _lines(out: Path, group: int, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"g{group}r{rank}.jsonl").read_text().splitlines()]


def _records(out: Path, group: int, rank: int) -> list[dict]:
    """The outcome of every step attempt that got as far as ``optimizer.step()``."""
    return [line for line in _lines(out, group, rank) if "committed" in line]


def _batches(out: Path) -> dict[int, dict[int, list[list[int]]]]:
    """For every committed step, the samples of each group whose gradient went into it (per rank).

    A rank's own committed record names its samples. A rank killed after its gradient was averaged
    in but before it recorded the commit (its group, or the other rank of its group, committed that
    step; or the committing group counted more participants than groups that recorded a commit)
    is read from its last attempt at that step, logged before backward.
    """
    committed: dict[tuple[int, int, int], list[int]] = {}  # (step, group, rank) -> samples
    participants: dict[int, int] = {}
    for group in range(2):
        for rank in range(2):
            for record in _records(out, group, rank):
                if record["committed"] and record["contributed"]:
                    committed[(record["step"], group, rank)] = record["indices"]
                    participants[record["step"]] = record["participants"]

    def samples(step: int, group: int, rank: int) -> list[int]:
        if (step, group, rank) in committed:
            return committed[(step, group, rank)]
        attempts = [a for a in _lines(out, group, rank) if a.get("attempt") == step]
        return attempts[-1]["indices"]

    batches: dict[int, dict[int, list[list[int]]]] = {}
    for step, count in participants.items():
        groups = sorted({g for (s, g, _) in committed if s == step})
        groups += [g for g in range(2) if g not in groups][: count - len(groups)]
        assert len(groups) == count, (step, groups, count)
        batches[step] = {g: [samples(step, g, rank) for rank in range(2)] for g in groups}
    return batches


def _story(out: Path) -> str:
    """Each rank's attempts (A), commits (C step/participants) and failed steps (X), for a failure message."""

    def word(line: dict) -> str:
        if "attempt" in line:
            return f"A{line['attempt']}"
        healed = f"h{line['healed_at']}" if line["healed_at"] else ""
        return f"{'C' if line['committed'] else 'X'}{line['step']}/{line['participants']}{healed}"

    return "\n".join(
        f"g{g}r{r}: " + " ".join(map(word, _lines(out, g, r))) for g in range(2) for r in range(2)
    )


def _replay(out: Path) -> dict[str, torch.Tensor]:
    """The run in one process: each committed step averages the batches of the groups that took part."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import ft_group
    finally:
        sys.path.remove(str(SCRIPT.parent))
    batches = _batches(out)  # step -> group -> per-rank sample indices
    model = ft_group.build_model()
    optimizer = ft_group.build_optimizer(model)
    x_all, y_all = ft_group.data()
    for step in range(STEPS):
        losses = [
            torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
            for group in sorted(batches[step])
            for idx in batches[step][group]
        ]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: t.detach() for name, t in model.state_dict().items()}


def _kill_and_restart(out: Path, *mode: str, waits_for: str | None = None) -> tuple[str, float]:
    """Run both groups; kill group 1 at step ``KILL_AT`` and restart it, then let both finish.

    By default group 0 holds at step ``HOLD_AT`` (it kept committing alone) until group 1 is back.
    With ``waits_for`` group 0 cannot commit alone: group 1 is restarted once group 0 printed that
    line (it is waiting). Returns the output and how long group 0 went on without group 1.
    """
    os.environ["RUST_LOG"] = "error"  # read when torchft is first imported (restored after the test)
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=3000
    )
    job = Job(out, lighthouse.address())
    hold = [] if waits_for else ["--hold-at", str(HOLD_AT)]
    try:
        group0 = job.start(0, *hold, *mode)
        group1 = job.start(1, *mode)
        for tag in ("g0r0", "g0r1", "g1r0", "g1r1"):
            job.wait_for(rf"{tag} ready", timeout=240)
        (out / "go").touch()
        job.wait_for(rf"g1r0 step {KILL_AT} ")
        killed = job.mark()
        job.kill(group1)  # SIGKILL to the group's launcher and both ranks
        killed_at = time.monotonic()
        job.wait_for(waits_for or rf"g0r0 holding at step {HOLD_AT}", timeout=120, since=killed)
        survived = time.monotonic() - killed_at
        restart = job.mark()
        group1 = job.start(1, *mode)
        job.wait_for(r"g1r0 ready", timeout=240, since=restart)
        job.wait_for(r"g1r1 ready", timeout=240, since=restart)
        (out / "release").touch()
        assert group0.wait(timeout=300) == 0, job.output()
        assert group1.wait(timeout=120) == 0, job.output()
    finally:
        job.stop_all()
        lighthouse.shutdown()
    return job.output(), survived


def _check_rejoined(out: Path, output: str, overlap: bool = False) -> int:
    """The restarted group healed from group 0 before its first batch; returns the step it healed at."""
    for rank in range(2):
        records = _records(out, 1, rank)
        restarted = [r for r in records if any(h >= KILL_AT for h in r["healed_at"])]
        healed_at = restarted[0]["healed_at"]
        assert len(healed_at) == 1 and KILL_AT <= healed_at[0] < STEPS, output
        assert restarted[0]["step"] == healed_at[0] and restarted[0]["committed"], output
        # its gradient counts in that step (quorum before the forward) or from the next one (overlap)
        assert restarted[0]["contributed"] is not overlap, output
        assert restarted[0]["participants"] == (1 if overlap else 2), output
        assert restarted[1]["contributed"] and restarted[1]["participants"] == 2, output
        assert restarted[-1]["step"] == STEPS - 1, output
        # and took group 0's position in the data before it drew its first batch: from its first
        # step on each rank reads the batch beside group 0's (global rank 2 + r next to r: sample
        # i + 2). With overlap_quorum it draws its first batch before it heals (its gradient of
        # that step is not used) and reads beside group 0 from the next one.
        live = {r["step"]: r["indices"] for r in _records(out, 0, rank) if r["committed"]}
        for record in restarted[1:] if overlap else restarted:
            assert record["indices"] == [i + 2 for i in live[record["step"]]], _story(out)
    return healed_at[0]


def _check_equal_weights(out: Path) -> None:
    """Both groups hold bitwise equal weights (torchft's own check is only assert_close)."""
    for rank in range(2):
        a, b = torch.load(out / f"g0r{rank}.pt"), torch.load(out / f"g1r{rank}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), (rank, _story(out))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("overlap", [False, True], ids=["quorum-before-forward", "overlap-quorum"])
def test_killed_group_rejoins_heals_from_a_live_group_and_ends_equal(tmp_path: Path, overlap: bool) -> None:
    output, survived = _kill_and_restart(tmp_path, *(["--overlap-quorum"] if overlap else []))
    records = {(g, r): _records(tmp_path, g, r) for g in range(2) for r in range(2)}
    # the data: before the kill the 4 ranks read 4 different parts of every step's samples
    first = [set(records[(g, r)][0]["indices"]) for g in range(2) for r in range(2)]
    assert len(set.union(*first)) == sum(map(len, first)) == 8, first
    # the live group committed steps alone while the other was dead, and never healed after step 0
    # (at step 0 torchft makes every group copy one group's weights: they start equal)
    alone = [r for r in records[(0, 0)] if r["committed"] and r["participants"] == 1]
    assert alone, output
    assert all(h == 0 for r in records[(0, 0)] + records[(0, 1)] for h in r["healed_at"]), output
    healed_at = _check_rejoined(tmp_path, output, overlap)
    _check_equal_weights(tmp_path)
    # and equal the run replayed in one process from which group's batches each step averaged
    expected = _replay(tmp_path)
    final = torch.load(tmp_path / "g0r0.pt")
    torch.testing.assert_close(
        final, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{m}\n{_story(tmp_path)}"
    )
    # one group wrote the checkpoint
    assert "g0r0 done at step 16 wrote_checkpoint=True" in output
    assert "g1r0 done at step 16 wrote_checkpoint=False" in output
    assert (tmp_path / "ckpt").is_dir()
    print(f"the live group went on alone for {survived:.1f} s; healed at step {healed_at}")


@pytest.mark.timeout(600)
def test_16_mixed_with_an_overflow_and_a_scheduler_heals_scale_and_schedule(tmp_path: Path) -> None:
    """The rejoining group takes the live group's loss scale (halved by an overflow) and schedule."""
    mode = ("--precision", "16-mixed", "--overflow-at", "2", "--scheduler")
    output, _ = _kill_and_restart(tmp_path, *mode)
    records = {(g, r): _records(tmp_path, g, r) for g in range(2) for r in range(2)}
    # the overflow at step 2 skipped that update and halved the scale, on every rank of both groups
    for key, rank_records in records.items():
        by_step = {r["step"]: r for r in rank_records if r["committed"] and r["step"] <= KILL_AT}
        assert by_step[1]["scale"] == 65536.0 and by_step[2]["scale"] == 32768.0, (key, output)
    # at every committed step all ranks of both groups step with the same scale and learning rate
    seen: dict[int, tuple] = {}
    for key, rank_records in records.items():
        for r in rank_records:
            if r["committed"]:
                state = (r["scale"], r["lr"], r["scheduler"])
                assert seen.setdefault(r["step"], state) == state, (key, r["step"], _story(tmp_path))
    _check_rejoined(tmp_path, output)
    _check_equal_weights(tmp_path)


@pytest.mark.timeout(600)
def test_with_min_replica_groups_equal_to_all_the_live_group_waits_without_drawing(tmp_path: Path) -> None:
    """``min_replica_groups=2``: while group 1 is dead, group 0 draws no batch and drops no step."""
    waiting = r"Replica group 0: 1 group\(s\) take part and min_replica_groups=2: waiting"
    output, _ = _kill_and_restart(tmp_path, "--min-groups", "2", "--quorum-timeout", "300", waits_for=waiting)
    for rank in range(2):
        lines = _lines(tmp_path, 0, rank)
        attempts = [line for line in lines if "attempt" in line]
        committed = [r for r in lines if r.get("committed")]
        failed = [r for r in lines if r.get("committed") is False]
        # every committed step averaged both groups; at most the step running at the kill failed,
        # and no other batch was drawn: each attempt is a committed step or that one failed step
        assert all(r["participants"] == 2 for r in committed), _story(tmp_path)
        assert len(committed) == STEPS and len(failed) <= 1, _story(tmp_path)
        assert len(attempts) == len(committed) + len(failed), _story(tmp_path)
    _check_rejoined(tmp_path, output)
    _check_equal_weights(tmp_path)
    torch.testing.assert_close(
        torch.load(tmp_path / "g0r0.pt"),
        _replay(tmp_path),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"{m}\n{_story(tmp_path)}",
    )
