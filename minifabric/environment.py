"""Where the processes come from: cluster detection and process-group initialization.

Cluster detection reuses lightning-fabric's ``ClusterEnvironment`` classes (torchrun/TorchElastic,
SLURM, LSF, MPI), imported only when the scheduler's environment variables are present: importing
lightning-fabric costs about a second, which a local run should not pay. When no cluster is
detected, :class:`LocalEnvironment` describes a local run whose other processes minifabric starts
itself (it behaves like lightning-fabric's ``LightningEnvironment``).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from minifabric._torch import intra_op_threads

if TYPE_CHECKING:
    from lightning_fabric.plugins.environments import ClusterEnvironment

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
EXIT_BARRIER_TIMEOUT = timedelta(seconds=10)

#: environment variables whose presence means a scheduler may have started this process, by the
#: lightning-fabric class that decides for sure (checked in this order)
_CLUSTER_HINTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TorchElasticEnvironment", ("TORCHELASTIC_RUN_ID",)),
    ("SLURMEnvironment", ("SLURM_NTASKS",)),
    ("LSFEnvironment", ("LSB_JOBID",)),
    ("MPIEnvironment", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")),
)


def find_free_port() -> int:
    """A TCP port that is free on this machine now (``STANDALONE_PORT`` if set, as in Fabric)."""
    if "STANDALONE_PORT" in os.environ:
        return int(os.environ["STANDALONE_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LocalEnvironment:
    """A run on this machine: minifabric starts the processes, or someone set ``LOCAL_RANK`` and did.

    Implements the interface of lightning-fabric's ``ClusterEnvironment`` (and behaves like its
    ``LightningEnvironment``) without importing it.
    """

    def __init__(self) -> None:
        self._main_port = -1
        self._global_rank = 0
        self._world_size = 1

    @property
    def creates_processes_externally(self) -> bool:
        """Whether the processes were started by someone else (``LOCAL_RANK`` is set)."""
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        """Rank 0's address (``MASTER_ADDR``, default 127.0.0.1)."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """Rank 0's port (``MASTER_PORT``, else a free port, chosen once)."""
        if self._main_port == -1:
            port = os.environ.get("MASTER_PORT")
            self._main_port = int(port) if port else find_free_port()
        return self._main_port

    @staticmethod
    def detect() -> bool:
        """A local run is always possible."""
        return True

    def world_size(self) -> int:
        """Number of processes in the run."""
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Set the number of processes in the run."""
        self._world_size = size

    def global_rank(self) -> int:
        """Rank of this process in the run."""
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Set the rank of this process in the run (also for lightning's ``rank_zero_only`` loggers)."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        self._global_rank = rank
        rank_zero_only.rank = rank  # type: ignore[attr-defined]

    def local_rank(self) -> int:
        """Rank of this process on this machine (``LOCAL_RANK``, default 0)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def node_rank(self) -> int:
        """Rank of this machine (``NODE_RANK`` or ``GROUP_RANK``, default 0)."""
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))

    def teardown(self) -> None:
        """Forget the world size set for this run."""
        os.environ.pop("WORLD_SIZE", None)


def detect_cluster_environment() -> ClusterEnvironment | LocalEnvironment:
    """Return the environment of the scheduler that started this process, or a local one."""
    for name, hints in _CLUSTER_HINTS:
        if any(var in os.environ for var in hints):
            from lightning_fabric.plugins import environments

            env_cls: Any = getattr(environments, name)
            if env_cls.detect():
                return env_cls()
    return LocalEnvironment()


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_cpu_cores(local_processes: int, warn: bool) -> None:
    """Give each of the ``local_processes`` ranks on this machine its share of the cores.

    Unless ``OMP_NUM_THREADS`` says otherwise, every rank gets ``cores // local_processes`` intra-op
    threads (at least one) instead of one per core each, which makes the ranks fight over the
    cores. With more processes than cores, ``warn`` (rank 0) says so once.
    """
    cores = available_cores()
    if warn and local_processes > cores:
        warnings.warn(
            f"{local_processes} processes on this machine but only {cores} CPU cores: the ranks will"
            f" slow each other down. Use at most {cores}, e.g. Accelerator(devices={cores}).",
            stacklevel=2,
        )
    if "OMP_NUM_THREADS" not in os.environ:
        intra_op_threads(max(1, cores // local_processes))


def local_world_size(env: Any, num_nodes: int) -> int:
    """Processes on this node, for environments that created them."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if "SLURM_NTASKS_PER_NODE" in os.environ:
        return int(os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0])
    return max(1, env.world_size() // max(1, num_nodes))


def init_process_group(env: Any, backend: str, timeout: timedelta) -> None:
    """Join the default process group described by ``env`` (no-op if already initialized)."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    rank, world_size = env.global_rank(), env.world_size()
    log.info("Initializing process group: rank %d of %d, backend %s", rank, world_size, backend)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def default_backend(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def exit_barrier_group() -> dist.ProcessGroup | None:
    """A gloo group whose only use is the barrier at exit, with a short timeout.

    Being separate from the training group, its barrier can never be matched against a training
    collective that another rank is still blocked in; the timeout bounds how long a rank that
    finished waits for one that did not.
    """
    return dist.new_group(backend="gloo", timeout=EXIT_BARRIER_TIMEOUT)


def destroy_process_group(barrier_group: dist.ProcessGroup | None = None) -> None:
    """Leave the default process group cleanly.

    A garbage collection and a barrier before destroying the group avoid an abort at interpreter
    exit seen with gloo after DTensor collectives. A barrier that times out (a rank left early or is
    stuck) is not an error here: there is nobody left to wait for.
    """
    if not dist.is_initialized():
        return
    import gc

    gc.collect()
    try:
        dist.barrier(group=barrier_group)
    except RuntimeError:
        pass
    finally:
        dist.destroy_process_group()
