"""Where the processes come from: cluster detection and process-group initialization.

Cluster detection reuses lightning-fabric's ``ClusterEnvironment`` classes (torchrun/TorchElastic,
SLURM, LSF, MPI). When none is detected, :class:`LightningEnvironment` describes a local run whose
other processes minifabric starts itself.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
EXIT_BARRIER_TIMEOUT = timedelta(seconds=10)


def detect_cluster_environment() -> ClusterEnvironment:
    """Return the environment of the scheduler that started this process, or a local one."""
    for env_cls in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment):
        if env_cls.detect():
            return env_cls()
    return LightningEnvironment()


def local_world_size(env: ClusterEnvironment, num_nodes: int) -> int:
    """Processes on this node, for environments that created them."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if "SLURM_NTASKS_PER_NODE" in os.environ:
        return int(os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0])
    return max(1, env.world_size() // max(1, num_nodes))


def init_process_group(env: ClusterEnvironment, backend: str, timeout: timedelta) -> None:
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
