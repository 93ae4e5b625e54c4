"""Joining the default process group: check the world first, then meet the other ranks with a deadline.

``torch.distributed.init_process_group`` with ``env://`` trusts its variables: a rank outside the
world, a main address that does not resolve or a world size larger than the processes started
leave every rank waiting for the collective timeout (30 minutes). Here each rank

1. checks its rank against the world size and resolves the main address (naming the variable that
   is wrong, at once),
2. connects to the key-value store and announces itself, then waits for every other rank for at
   most the *join timeout*: ``MINIFABRIC_JOIN_TIMEOUT`` seconds if set; else 5 s when nothing
   counted the processes (each was given ``RANK`` and ``WORLD_SIZE`` by hand or by a pod operator,
   ``World.counted`` False) and the main address is this machine, since every rank was then
   started here, together; else the collective timeout (torchrun, srun, minifabric's launcher
   start exactly ``WORLD_SIZE`` processes, which may only be slow to start on a loaded machine, and
   pods and nodes may start minutes apart). Rank 0 names the missing ranks every 30 s,
3. only then creates the process group on that store.

Under torchrun with restarts (``--max-restarts``), every attempt of the job talks to the same
store, hosted by the elastic agent, and the keys of a failed attempt are still in it: gloo would
read the dead ranks' addresses and fail with "connectFullMesh failed ... Connection refused". Each
attempt therefore uses its own key prefix (``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from minifabric import process

log = logging.getLogger(__name__)

#: environment variable: seconds to wait for every rank to arrive at the start of a run
JOIN_TIMEOUT_VAR = "MINIFABRIC_JOIN_TIMEOUT"
#: the join timeout when every rank runs on this machine
LOCAL_JOIN_SECONDS = 5.0
_REPORT_EVERY_SECONDS = 30.0
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class World:
    """Where this rank meets the others, and which variables said so (named in every error).

    Args:
        rank: this process's global rank.
        world_size: number of processes in the run.
        address: rank 0's address.
        port: the port of the key-value store on ``address``.
        rank_var: the environment variable the rank came from (e.g. ``"RANK"``, ``"SLURM_PROCID"``).
        world_size_var: the variable the world size came from.
        address_var: the variable the address came from.
        port_var: the variable the port came from.
        counted: whether the launcher itself started ``world_size`` processes (torchrun, srun,
            minifabric's launcher), rather than each process being given its variables by hand.
    """

    rank: int
    world_size: int
    address: str
    port: int
    rank_var: str = "RANK"
    world_size_var: str = "WORLD_SIZE"
    address_var: str = "MASTER_ADDR"
    port_var: str = "MASTER_PORT"
    counted: bool = True

    def describe(self) -> str:
        """The variables as one would set them, e.g. ``RANK=1 WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=...``."""
        return (
            f"{self.rank_var}={self.rank} {self.world_size_var}={self.world_size}"
            f" {self.address_var}={self.address} {self.port_var}={self.port}"
        )


def check_world(world: World) -> None:
    """Refuse a rank outside the world, a world size below 1 and a port out of range (no waiting).

    Raises:
        ValueError: naming the variable that is wrong.
    """
    if world.world_size < 1:
        raise ValueError(
            f"{world.world_size_var}={world.world_size} is not a number of processes; set it to the"
            f" number of processes the job starts ({world.describe()})."
        )
    if not 0 <= world.rank < world.world_size:
        raise ValueError(
            f"{world.rank_var}={world.rank} is outside the world of {world.world_size_var}={world.world_size}"
            f" processes: ranks run from 0 to {world.world_size - 1}. Give each process its own rank in that"
            f" range, or fix {world.world_size_var} ({world.describe()})."
        )
    if not 0 < world.port < 2**16:
        raise ValueError(f"{world.port_var}={world.port} is not a TCP port; use one in 1..65535.")


def is_this_machine(address: str) -> bool:
    """Whether ``address`` is a loopback address (or names one): every rank then runs on this machine."""
    try:
        infos = socket.getaddrinfo(address, None)
    except OSError:
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def resolve_address(world: World) -> None:
    """Raise at once when the main address does not resolve (instead of retrying until the timeout).

    Raises:
        ValueError: naming the address variable.
    """
    try:
        socket.getaddrinfo(world.address, world.port)
    except OSError as error:
        raise ValueError(
            f"{world.address_var}={world.address!r} does not resolve ({error}). Set it to the host name or"
            f" IP address of the machine that runs rank 0 ({world.describe()})."
        ) from None


def join_timeout(world: World, timeout: timedelta) -> float:
    """Seconds to wait for every rank (see the module docstring)."""
    value = os.environ.get(JOIN_TIMEOUT_VAR)
    if value:
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise ValueError(f"{JOIN_TIMEOUT_VAR}={value!r} must be a positive number of seconds, e.g. 600.")
        return seconds
    if not world.counted and is_this_machine(world.address):
        return LOCAL_JOIN_SECONDS
    return timeout.total_seconds()


def elastic_attempt() -> int | None:
    """The restart count of this attempt when torchrun's agent hosts the store, else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def store_host() -> int | None:
    """The rank whose process hosts the run's key-value store: 0, or None when torchrun's agent hosts it."""
    return None if elastic_attempt() is not None else 0


def _wait_for_listener(world: World, seconds: float) -> None:
    """Wait until rank 0's store accepts connections (torch's own client retries past its timeout)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((world.address, world.port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {world.rank} could not reach rank 0 at {world.address_var}={world.address}"
                    f" {world.port_var}={world.port} within {seconds:g} s ({error}). Check that rank 0 was"
                    f" started with the same {world.address_var} and {world.port_var}, or raise"
                    f" {JOIN_TIMEOUT_VAR} if it starts later."
                ) from None
        time.sleep(_POLL_SECONDS)


def _connect(world: World, seconds: float) -> dist.Store:
    attempt = elastic_attempt()
    host_here = attempt is None and world.rank == 0
    if not host_here:
        _wait_for_listener(world, seconds)
    try:
        store: dist.Store = dist.TCPStore(
            world.address,
            world.port,
            world.world_size,
            is_master=host_here,
            timeout=timedelta(seconds=seconds),
            wait_for_workers=False,
            multi_tenant=host_here,
        )
    except (RuntimeError, OSError) as error:  # DistNetworkError/DistStoreError derive from RuntimeError
        if host_here:
            hint = (
                f"rank 0 could not listen on {world.port_var}={world.port} ({error}): another process holds"
                f" the port (another job, or two processes with {world.rank_var}=0). Choose a free port."
            )
        else:
            hint = (
                f"rank {world.rank} could not reach rank 0 at {world.address_var}={world.address}"
                f" {world.port_var}={world.port} within {seconds:g} s ({error}). Check that rank 0 was"
                f" started with the same {world.address_var} and {world.port_var}, or raise"
                f" {JOIN_TIMEOUT_VAR} if it starts later."
            )
        raise RuntimeError(hint) from None
    if attempt is not None:
        # every attempt of an elastic job shares the agent's store: keep this attempt's keys apart
        store = dist.PrefixStore(f"minifabric/attempt-{attempt}/", store)
    return store


def _meet(store: dist.Store, world: World, seconds: float) -> None:
    """Announce this rank; wait until every rank has, or raise naming the missing ones."""
    arrivals = store.add(f"minifabric/arrived/{world.rank}", 1)
    keys = [f"minifabric/arrived/{r}" for r in range(world.world_size)]
    start = time.monotonic()
    reported = start
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            break
        now = time.monotonic()
        if now - start > seconds:
            raise RuntimeError(
                f"{world.world_size_var}={world.world_size}, but rank(s) {missing} did not arrive within"
                f" {seconds:g} s: {world.world_size_var} does not match the processes started, or they"
                f" start later (then set {JOIN_TIMEOUT_VAR} to the seconds to wait). {world.describe()}."
            )
        if world.rank == 0 and now - reported > _REPORT_EVERY_SECONDS:
            reported = now
            log.warning("waiting for rank(s) %s of %s=%d", missing, world.world_size_var, world.world_size)
        time.sleep(_POLL_SECONDS)
    if arrivals > 1 or int(store.get(keys[world.rank])) > 1:
        raise RuntimeError(
            f"two processes were started with {world.rank_var}={world.rank}: give each process its own"
            f" rank ({world.describe()})."
        )


def join(world: World, backend: str, timeout: timedelta) -> None:
    """Check ``world``, meet every rank within the join timeout, then create the default process group.

    Args:
        world: this rank's place in the run.
        backend: ``"gloo"``, ``"nccl"``, ...
        timeout: the collective timeout of the process group.

    Raises:
        ValueError: a rank, world size, address or port that cannot be right (the variable is named).
        RuntimeError: rank 0 cannot be reached, or not every rank arrived within the join timeout.
    """
    check_world(world)
    resolve_address(world)
    seconds = join_timeout(world, timeout)
    process.publish_main_address(world.address, world.port)
    store = _connect(world, seconds)
    _meet(store, world, seconds)
    store.set_timeout(timeout)
    log.info("Initializing process group: rank %d of %d, backend %s", world.rank, world.world_size, backend)
    dist.init_process_group(
        backend, store=store, rank=world.rank, world_size=world.world_size, timeout=timeout
    )
