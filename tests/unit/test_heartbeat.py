"""The heartbeat's setting and its bookkeeping on a real store, in one process (the faults themselves: tests/distributed/test_faults.py)."""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from minifabric.runtime import heartbeat, launcher
from minifabric.runtime.liveness import BoundedStore, StoreSilent, is_stopped, pid_ended, progress
from tests.helpers import free_port


def test_the_timeout_comes_from_the_environment_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.delenv(heartbeat.HEARTBEAT_VAR, raising=False)
    assert heartbeat.heartbeat_timeout() == 60.0
    monkeypatch.setenv(heartbeat.HEARTBEAT_VAR, "7.5")
    assert heartbeat.heartbeat_timeout() == 7.5
    monkeypatch.setenv(heartbeat.HEARTBEAT_VAR, "0")
    assert heartbeat.heartbeat_timeout() == 0.0  # off
    for bad in ("soon", "-1"):
        monkeypatch.setenv(heartbeat.HEARTBEAT_VAR, bad)
        with pytest.raises(
            ValueError, match=rf"MINIFABRIC_HEARTBEAT_TIMEOUT='{bad}'.*MINIFABRIC_HEARTBEAT_TIMEOUT=60"
        ):
            heartbeat.heartbeat_timeout()


def test_a_dead_process_on_this_host_is_seen_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_ended(child.pid) == (True, None)  # reaped: how it ended is lost
    assert pid_ended(os.getpid()) == (False, None)


@pytest.mark.parametrize(
    ("signum", "how"),
    [
        (signal.SIGSEGV, "was killed by SIGSEGV"),
        (signal.SIGKILL, "was killed by SIGKILL"),
        (None, "exited with code 3"),
    ],
)
def test_a_dead_process_not_reaped_yet_tells_how_it_ended(signum, how):
    code = "import sys; sys.exit(3)" if signum is None else "import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        if signum is not None:
            os.kill(child.pid, signum)
        while pid_ended(child.pid) == (False, None):  # until it is a zombie (not reaped)
            time.sleep(0.01)
        assert pid_ended(child.pid) == (True, how)
    finally:
        child.kill()
        child.wait()


def test_the_first_posted_cause_wins_and_a_rank_does_not_blame_itself():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    mine = heartbeat.Heartbeat(store, rank=0, world_size=2, timeout=5)
    peer = heartbeat.Heartbeat(store, rank=1, world_size=2, timeout=5)
    assert mine.posted_fault() is None
    peer.post_fault("rank 1 (host h, pid 1) failed with MemoryError")
    mine.post_fault("rank 0 (host h, pid 2) failed with RuntimeError")  # too late: the first cause stays
    assert mine.posted_fault() == "rank 1 (host h, pid 1) failed with MemoryError"
    assert peer.posted_fault() is None  # its own post


def test_a_peer_that_left_on_purpose_is_not_blamed():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = heartbeat.Heartbeat(store, rank=0, world_size=2, timeout=5)
    mine.peers = {1: (heartbeat.HOST, child.pid)}
    assert mine.dead_peer() == (1, None)
    assert (
        mine.culprit()
        == f"rank 1 (host {heartbeat.HOST}, pid {child.pid}) ended without a report (killed by a signal?)"
    )
    heartbeat.Heartbeat(
        store, rank=1, world_size=2, timeout=5
    ).stop()  # rank 1 leaves at the end of its script
    assert mine.dead_peer() is None


def test_a_dead_peer_seen_with_its_signal_is_posted_for_the_ranks_that_look_later():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGABRT)
        mine = heartbeat.Heartbeat(store, rank=0, world_size=3, timeout=5)
        mine.peers = {1: (heartbeat.HOST, child.pid)}
        while pid_ended(child.pid)[0] is False:
            time.sleep(0.01)
        blamed = f"rank 1 (host {heartbeat.HOST}, pid {child.pid}) was killed by SIGABRT"
        assert mine.culprit() == blamed
    finally:
        child.kill()
        child.wait()  # reaped: the signal can no longer be read, but rank 0 posted it
    later = heartbeat.Heartbeat(store, rank=2, world_size=3, timeout=5)
    later.peers = {1: (heartbeat.HOST, child.pid)}
    assert later.culprit() == blamed


def test_the_exit_watch_reads_the_signal_of_a_peer_the_moment_it_ends():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mine = heartbeat.Heartbeat(store, rank=0, world_size=2, timeout=5)
    mine.peers = {1: (heartbeat.HOST, child.pid)}
    watch = threading.Thread(target=mine._watch_exits, daemon=True)
    watch.start()
    try:
        time.sleep(0.2)  # the watch has opened its pidfd
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while mine._dead is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mine._dead == f"rank 1 (host {heartbeat.HOST}, pid {child.pid}) was killed by SIGKILL"
    finally:
        mine.stopped.set()
        child.kill()
        child.wait()
        watch.join(timeout=5)
    assert not watch.is_alive()


def _store_host(port: int) -> subprocess.Popen:
    """A process that hosts a TCPStore on ``port`` (as rank 0 does) and prints one line once it listens."""
    code = (
        "import time, torch.distributed as dist; from datetime import timedelta;"
        f" store = dist.TCPStore('127.0.0.1', {port}, 1, True, timeout=timedelta(seconds=60),"
        " wait_for_workers=False); print('up', flush=True); time.sleep(60)"
    )
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None and host.stdout.readline() == "up\n"
    return host


def test_a_store_call_to_a_stopped_host_gives_up_at_its_deadline_and_the_store_answers_again_later():
    port = free_port()
    host = _store_host(port)
    try:
        store = BoundedStore(dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=600)))
        assert store.call(5, "add", "beat", 1) == 1
        os.kill(host.pid, signal.SIGSTOP)  # torch's own call would wait forever, whatever its timeout
        with pytest.raises(StoreSilent, match="no answer"):
            store.call(0.5, "add", "beat", 1)
        os.kill(host.pid, signal.SIGCONT)
        assert store.call(30, "add", "beat", 0) == 2  # the call in flight went through
    finally:
        host.kill()
        host.wait()


def test_the_kernel_tells_a_stopped_process_from_one_at_work():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = {p.pid: progress(p.pid) for p in (busy, idle)}
        time.sleep(1.0)
        after = {p.pid: progress(p.pid) for p in (busy, idle)}
        assert after[busy.pid][1] > before[busy.pid][1]  # its CPU time advances
        assert not is_stopped(after[busy.pid][0]) and not is_stopped(after[idle.pid][0])
        os.kill(busy.pid, signal.SIGSTOP)
        while progress(busy.pid)[0] not in ("T", "t"):
            time.sleep(0.01)
        assert is_stopped(progress(busy.pid)[0])
        assert progress(2**22 + 12345) is None  # no such process
    finally:
        for child in (busy, idle):
            child.kill()
            child.wait()


def test_the_launcher_says_why_before_it_kills_a_rank_still_running_after_ctrl_c(capfd):
    rank = launcher._ScriptRank([sys.executable, "-c", "import time; time.sleep(60)"], {})
    supervisor = launcher._Supervisor({0: rank})
    supervisor.interrupted_at = time.monotonic() - 60  # Ctrl-C long ago; the rank ignored it
    assert supervisor._wait() == 130
    assert rank.exit_code() == -signal.SIGKILL
    grace = f"{launcher.signals.INTERRUPT_GRACE_SECONDS:g}"
    assert capfd.readouterr().err == f"[minifabric] {heartbeat.HOST}: killing rank(s) [0]: still running {grace}s after Ctrl-C.\n"


@pytest.mark.parametrize("ending", ["exit 0", "SIGKILL"])
def test_the_rank_that_hosts_the_store_is_blamed_only_for_an_end_its_exit_status_shows_as_bad(ending):
    # it cannot post that it left once it is gone: its store went with it
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10))
    child = subprocess.Popen([sys.executable, "-c", "pass" if ending == "exit 0" else "import time; time.sleep(60)"])
    if ending == "SIGKILL":
        child.kill()
    while not pid_ended(child.pid)[0]:  # a zombie: its parent (this test) has not reaped it
        time.sleep(0.01)
    try:
        mine = heartbeat.Heartbeat(store, rank=1, world_size=2, timeout=5, store_host=0)
        mine.peers = {0: (heartbeat.HOST, child.pid)}
        if ending == "exit 0":
            assert mine.culprit() is None
        else:
            assert mine.culprit() == f"rank 0 (host {heartbeat.HOST}, pid {child.pid}) was killed by SIGKILL"
    finally:
        child.wait()
