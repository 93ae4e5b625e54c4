"""Where the processes come from: cluster detection and process-group initialization.

In this order: a default process group that already exists (Ray Train creates one before the
user's code runs; so may the user) is adopted as it is (:class:`ProcessGroupEnvironment`); then
lightning-fabric's ``ClusterEnvironment`` classes decide for torchrun/TorchElastic, SLURM, LSF and
MPI, imported only when the scheduler's variables are present (importing lightning-fabric costs
about a second, which a local run should not pay); then one process per pod or machine started with
``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` but no ``LOCAL_RANK`` (Kubeflow's
PyTorchJob) is lightning's ``KubeflowEnvironment``. When none of these is found,
:class:`LocalEnvironment` describes a local run whose other processes minifabric starts itself (it
behaves like lightning-fabric's ``LightningEnvironment``).

A broken environment raises naming the variable, never falls back to a local run: a SLURM job
without a node list, ``PET_NPROC_PER_NODE`` above 1 outside torchrun, and (when joining, see
:mod:`minifabric.runtime.rendezvous`) a rank outside the world, an address that does not resolve or ranks
that never arrive.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from minifabric import process
from minifabric._torch import intra_op_threads
from minifabric.runtime.rendezvous import World, join

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
        process.forget_world_size()


class ProcessGroupEnvironment(LocalEnvironment):
    """A default process group created before the Accelerator (by Ray Train, or by the user): adopted.

    Rank and world size are the group's; the local rank is ``LOCAL_RANK`` if set (Ray and torchrun
    set it), else 0; the node rank ``NODE_RANK``/``GROUP_RANK`` if set, else 0.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Always: the processes exist and are already connected."""
        return True

    def world_size(self) -> int:
        """The process group's world size."""
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the process group decides."""

    def global_rank(self) -> int:
        """This process's rank in the process group."""
        return dist.get_rank()


#: the variables each environment reads (rank, world size, address, port), named in its errors
_VARIABLES = MappingProxyType({
    "SLURMEnvironment": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST", "SLURM_JOB_ID"),
    "LSFEnvironment": ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "LSB_DJOB_RANKFILE", "LSB_JOBID"),
    "MPIEnvironment": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
})


def world_of(env: Any) -> World:
    """This rank's place in the run as ``env`` describes it, with the variables to name in errors."""
    rank_var, size_var, address_var, port_var = _VARIABLES.get(
        type(env).__name__, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    )
    if "MASTER_ADDR" in os.environ:
        address_var = "MASTER_ADDR"
    if "MASTER_PORT" in os.environ:
        port_var = "MASTER_PORT"
    return World(
        rank=env.global_rank(),
        world_size=env.world_size(),
        address=env.main_address,
        port=env.main_port,
        rank_var=rank_var,
        world_size_var=size_var,
        address_var=address_var,
        port_var=port_var,
        counted=type(env).__name__ != "KubeflowEnvironment",
    )


def _is_kubeflow() -> bool:
    """One process per pod (or machine): the four variables of ``env://`` and no ``LOCAL_RANK``."""
    required = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    return all(var in os.environ for var in required) and "LOCAL_RANK" not in os.environ


def _check_slurm() -> None:
    if "MASTER_ADDR" not in os.environ and "SLURM_NODELIST" not in os.environ:
        hint = (
            " (SLURM_JOB_NODELIST is set: export SLURM_NODELIST=$SLURM_JOB_NODELIST)"
            if "SLURM_JOB_NODELIST" in os.environ
            else ""
        )
        raise ValueError(
            "This process runs in a SLURM job (SLURM_NTASKS is set) but SLURM_NODELIST is not set, so"
            f" rank 0's host is unknown{hint}. Start the processes with srun inside an allocation"
            " (sbatch/salloc), or set MASTER_ADDR to rank 0's host."
        )


def _check_torchrun_in_pod() -> None:
    nproc = os.environ.get("PET_NPROC_PER_NODE", "1")
    if "TORCHELASTIC_RUN_ID" not in os.environ and nproc not in ("1", "auto"):
        raise ValueError(
            f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per pod, which torchrun starts (it reads"
            " the PET_* variables): run the script as `torchrun train.py` in the container, not"
            " `python train.py`."
        )


def detect_cluster_environment() -> ClusterEnvironment | LocalEnvironment:
    """Return the environment that started this process, or a local one (see the module docstring).

    Raises:
        ValueError: the environment is recognised but broken (naming the variable).
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupEnvironment()
    _check_torchrun_in_pod()
    for name, hints in _CLUSTER_HINTS:
        if any(var in os.environ for var in hints):
            from lightning_fabric.plugins import environments

            env_cls: Any = getattr(environments, name)
            if env_cls.detect():
                if name == "SLURMEnvironment":
                    _check_slurm()
                return env_cls()
    if _is_kubeflow():
        from lightning_fabric.plugins.environments import KubeflowEnvironment

        return KubeflowEnvironment()
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
    if type(env).__name__ == "KubeflowEnvironment":
        return 1  # one process per pod
    return max(1, env.world_size() // max(1, num_nodes))


def init_process_group(env: Any, backend: str, timeout: timedelta) -> None:
    """Join the default process group described by ``env`` (adopt it if it exists already).

    The world is checked first and every rank must arrive within the join timeout
    (:func:`minifabric.runtime.rendezvous.join`).
    """
    if dist.is_initialized():
        return
    join(world_of(env), backend, timeout)


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
