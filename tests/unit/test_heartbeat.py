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

from minifabric import heartbeat
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
    assert heartbeat._pid_ended(child.pid) == (True, None)  # reaped: how it ended is lost
    assert heartbeat._pid_ended(os.getpid()) == (False, None)


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
        while heartbeat._pid_ended(child.pid) == (False, None):  # until it is a zombie (not reaped)
            time.sleep(0.01)
        assert heartbeat._pid_ended(child.pid) == (True, how)
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
        while heartbeat._pid_ended(child.pid)[0] is False:
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
