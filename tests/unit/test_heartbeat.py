"""The heartbeat's setting and its bookkeeping on a real store, in one process (the faults themselves: tests/distributed/test_faults.py)."""

import os
import subprocess
import sys
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
    assert heartbeat._pid_gone(child.pid)
    assert not heartbeat._pid_gone(os.getpid())


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
    assert mine.dead_peer() == 1
    assert (
        mine.culprit()
        == f"rank 1 (host {heartbeat.HOST}, pid {child.pid}) ended without a report (killed by a signal?)"
    )
    heartbeat.Heartbeat(
        store, rank=1, world_size=2, timeout=5
    ).stop()  # rank 1 leaves at the end of its script
    assert mine.dead_peer() is None
