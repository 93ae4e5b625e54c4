"""The strategy seam: how a model is placed, wrapped and kept in sync across processes.

A strategy owns the world (ranks, device, process group) and the rank's life in it, places and wraps
modules (materializing a meta-device model), points optimizers at the parameters it produced, and
runs backward and the optimizer step through the precision plugin. It does not read or write
checkpoints: it tells the checkpoint service, as data, the layout to write (:attr:`state_dict_type`)
and whether this process writes at all, and hears which checkpoint was committed or loaded.
Subclasses override only what differs; the :class:`~minifabric.Accelerator` facade never branches on
the strategy type.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from minifabric import collectives, process
from minifabric._torch import return_freed_memory
from minifabric.init import (
    InitMismatch,
    materialize,
    places_to_materialize,
    self_check,
    wants_check,
)
from minifabric.parameters import optimizer_parameters
from minifabric.precision import Precision
from minifabric.runtime.environment import DEFAULT_TIMEOUT, LocalEnvironment, default_backend, share_cpu_cores
from minifabric.runtime.launcher import JoinLauncher, Launcher, LocalLauncher
from minifabric.runtime.rank import Rank, check_adopted_timeout, collective_timeout, ending_badly
from minifabric.strategies.compile import (
    CompileOption,
    Compiler,
    check_compile_option,
    compile_modules,
    resolve_compiler,
    split_compiled,
)
from minifabric.strategies.init_context import module_init_context
from minifabric.strategies.rank_zero_init import adopt_rank_zero_init

if TYPE_CHECKING:
    from lightning_fabric.plugins.environments import ClusterEnvironment


class Strategy:
    """Base strategy: one process, one device, no wrapping.

    Args:
        timeout: how long a collective may wait before it fails (``timedelta`` or seconds); then every
            rank prints its stack and the run ends. Default: ``MINIFABRIC_TIMEOUT`` seconds if set,
            else 30 minutes.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: nccl on CUDA, gloo on CPU.
        compile: ``torch.compile`` what the strategy runs: ``True`` (torch.compile's defaults) or a
            dict of ``torch.compile`` keyword arguments (``{"mode": "max-autotune"}``). A model
            passed as ``torch.compile(model)`` is compiled the same way, with its own options.
            Parameter names and checkpoints never carry ``_orig_mod.``.
    """

    def __init__(
        self,
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        process_group_backend: str | None = None,
        compile: CompileOption = False,
    ) -> None:
        check_compile_option(compile)
        self.compile = compile
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._timeout_given = timeout is not DEFAULT_TIMEOUT
        #: this process's life as a rank of the run: joining, should_stop, leaving (:mod:`minifabric.runtime`)
        self.rank = Rank()
        self.process_group_backend = process_group_backend
        self.precision: Precision = Precision()
        self.environment: ClusterEnvironment | LocalEnvironment = LocalEnvironment()
        self.root_device = torch.device("cpu")
        self.num_nodes = 1
        self.num_processes = 1  # on this node
        #: ``launch()`` must be given a function (``strategy="ddp_spawn"``, as in Fabric)
        self.spawn_only = False
        #: inside :meth:`backward` (a plain ``loss.backward()`` runs with this False)
        self.in_backward = False

    # ---- the world ---------------------------------------------------------------------------

    def connect(
        self,
        *,
        environment: ClusterEnvironment | LocalEnvironment,
        device: torch.device,
        num_processes: int,
        num_nodes: int,
        precision: Precision,
    ) -> None:
        """Receive the resolved environment, device and precision (called once by the Accelerator)."""
        self.environment = environment
        if isinstance(environment, LocalEnvironment) and not environment.creates_processes_externally:
            # the configured world, also before `launch()` starts it (as Fabric reports it)
            environment.set_world_size(num_nodes * num_processes)
        self.root_device = device
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.precision = precision
        self._check_world()

    def _check_world(self) -> None:
        """Raise if this strategy's own settings (e.g. a mesh) do not fit the world just received."""

    @property
    def world_size(self) -> int:
        """Number of processes in the run."""
        return self.environment.world_size()

    @property
    def global_rank(self) -> int:
        """Rank of this process in the run."""
        return self.environment.global_rank()

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.environment.local_rank()

    @property
    def node_rank(self) -> int:
        """Rank of this process's node."""
        return self.environment.node_rank()

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """How ``setup_dataloaders`` splits the data: ``num_replicas`` parts, this rank reads part ``rank``.

        Every rank reads its own part here; a strategy whose ranks cooperate on one batch (tensor
        parallel) splits by its data-parallel group instead.
        """
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def launcher(self) -> Launcher:
        """Starts the other local processes when nothing else did."""
        if self.num_processes > 1 and not self.environment.creates_processes_externally:
            return LocalLauncher(self.num_processes, self.environment.main_address)
        return JoinLauncher()

    def setup_environment(self) -> None:
        """Join the process group (if there is more than one process) and select the device."""
        if isinstance(self.environment, LocalEnvironment):
            self.environment.set_world_size(self.num_nodes * self.num_processes)
            self.environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if self.root_device.type == "cpu" and self.world_size > 1:
            share_cpu_cores(self.num_processes, warn=self.is_global_zero)
            return_freed_memory()
        self.rank.prepare(self.global_rank, self.world_size)
        if self.world_size > 1:
            self._init_process_group()

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            check_adopted_timeout(self.timeout, self._timeout_given)
            return
        backend = self.process_group_backend or default_backend(self.root_device)
        self.timeout = collective_timeout(self.timeout, self._timeout_given)
        self.rank.join(self.environment, backend, self.timeout)
        process.at_exit(self._teardown_at_exit)

    def teardown(self) -> None:
        """Leave the process group.

        An asynchronous save still writing has finished by then: its thread is not a daemon, so the
        interpreter waits for it before running this at exit.
        """
        self.rank.leave()

    def _teardown_at_exit(self) -> None:
        # After an error, an interrupt or a non-zero exit the other ranks may never reach a
        # barrier: leave at once (the launcher ends them). Otherwise leave together, which also
        # avoids an abort at exit seen with gloo after DTensor collectives.
        if not ending_badly():
            self.teardown()

    @property
    def should_stop(self) -> bool:
        """Whether any rank got SIGTERM/SIGUSR1 or Ray Train reports a preemption; a collective."""
        return self.rank.should_stop()

    # ---- modules and optimizers --------------------------------------------------------------

    def module_init_context(self, empty_init: bool | None = None, verify: bool = False) -> ContextManager:
        """Where and in which dtype ``init_module`` creates a model (``verify``: see ``init_module``)."""
        return module_init_context(self, bool(empty_init), verify)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Materialize, convert precision and move to device; return the module forward should call.

        ``module`` itself is changed in place (its parameters keep their names); the returned module
        may wrap it. A ``torch.compile(model)`` is unwrapped; the returned module is compiled.
        """
        module, compiler = self._compiler(module)
        forward_module = self._place_module(module)
        if compiler is not None:
            compile_modules([forward_module], compiler)
        return forward_module

    def _compiler(self, module: nn.Module) -> tuple[nn.Module, Compiler | None]:
        """``module`` without its ``torch.compile`` wrapper, and the compile to re-apply (the one split).

        The user's compile options win over ``compile=`` (see :mod:`~minifabric.strategies.compile`).
        """
        module, user_compiler = split_compiled(module)
        return module, resolve_compiler(self.compile, user_compiler)

    def _place_module(self, module: nn.Module) -> nn.Module:
        """Materialize, convert precision and move to device (subclasses wrap the result)."""
        self._materialize(module, self._recorded_places(module), self.root_device)
        module = self.precision.convert_module(module)
        return module.to(self.root_device)

    @property
    def parameter_device(self) -> torch.device:
        """Where this rank's parameters live after ``setup`` (the CPU when FSDP offloads them)."""
        return self.root_device

    def meta_init_part(self) -> tuple[int, int] | None:
        """Which part of each parameter this rank holds after ``setup``: chunk ``index`` of ``parts``
        along dim 0, as ``(parts, index)``; None if it is not one such chunk.

        ``init_module(empty_init=True)`` keeps that part of each value a random init computes at
        construction, so ``setup`` does not run the init again. One process holds everything.
        """
        return (1, 0) if self.world_size == 1 else None

    def _recorded_places(self, module: nn.Module) -> list:
        """The recorded init of ``module``'s meta tensors (:func:`minifabric.init.recorded_places`).

        A model built under plain ``torch.device("meta")`` (outside ``init_module``) is materialized
        here as Lightning Fabric does: ``to_empty`` and each module's ``reset_parameters()``.
        """
        return places_to_materialize(module, self.root_device)

    def _materialize(
        self,
        module: nn.Module,
        places: list,
        device: torch.device,
        buffer_device: torch.device | None = None,
        built: nn.Module | None = None,
    ) -> None:
        """Give ``module``'s meta tensors their eager values (:func:`minifabric.init.materialize`).

        Any parameter layout works (plain tensors, DTensors of any placement on any mesh), so a
        strategy calls this after placing the model. With several ranks, each replays rank 0's random
        draws (a script may seed each rank differently before building the model: rank 0's model is
        the one set up, as under DDP). A model built with the self-check on is compared with an eager
        build on rank 0; a difference raises on every rank. ``built``: the model as constructed, when
        ``module`` is another one that holds it (a ``parallelize_fn``'s).
        """
        built = module if built is None else built
        if not places:
            return
        checking = wants_check(built)
        if self.world_size > 1 and self.any_rank(checking) and self.any_rank(not checking):
            raise ValueError(
                "The meta-init self-check was asked for on some ranks only (`verify=` or MINIFABRIC_VERIFY_INIT"
                " differs between ranks). Ask for it on every rank (it runs on rank 0 only):"
                " `acc.init_module(empty_init=True, verify=True)`."
            )
        if self.world_size > 1:  # per-rank seeds before construction: every rank replays rank 0's draws
            adopt_rank_zero_init(places, self.global_rank)
        if not checking:
            materialize(module, places, device, buffer_device)
            return
        error = None
        try:
            check = self_check(built, self.precision.tensor_init_context, module) if self.is_global_zero else None
            materialize(module, places, device, buffer_device, on_value=check)
        except InitMismatch as e:
            error = str(e)
        if self.world_size > 1:
            error = self.broadcast(error, src=0)
        if error is not None:
            raise InitMismatch(error)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Return the optimizer to step (e.g. a sharded replacement)."""
        return optimizer

    def setup_dataloader(self, dataloader: Any) -> None:
        """Called with every loader ``setup_dataloaders`` returns (nothing to do here)."""

    def setup_scheduler(self, scheduler: Any) -> None:
        """Called with the LR scheduler given to ``setup(..., scheduler=)`` (nothing to do here)."""

    def forward_context(self) -> ContextManager:
        """The context the wrapped module's forward runs in."""
        return self.precision.forward_context()

    @property
    def requires_backward_call(self) -> bool:
        """Whether a plain ``loss.backward()`` on the set-up model's output is refused (as in Fabric).

        True where backward must go through :meth:`backward` (mixed precision here; FSDP always),
        so a forgotten ``acc.backward(loss)`` fails at once instead of training differently.
        """
        return self.precision.is_mixed

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Run backward through the precision plugin."""
        self.in_backward = True
        try:
            self.precision.pre_backward(tensor).backward(*args, **kwargs)
        finally:
            self.in_backward = False

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step through the precision plugin (gradient scaler); local: no communication of its own."""
        result = self.precision.optimizer_step(optimizer, **kwargs)
        self.rank.step_done()
        return result

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip gradient synchronization inside the context (no-op with one process)."""
        return nullcontext()

    #: how the norm is taken and applied: torch's for whole gradients; sharded strategies set
    #: ``fsdp_grads.clip_grad_norm_`` (the norm over all shards, a plain tensor on every rank)
    _clip_grad_norm: Callable[..., torch.Tensor] = staticmethod(torch.nn.utils.clip_grad_norm_)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip gradients by their total norm (across all shards) and return that norm.

        With ``error_if_nonfinite`` a NaN or infinite norm raises (torch's error) and leaves the
        gradients as they were.
        """
        self.precision.unscale_gradients(optimizer)
        params = optimizer_parameters(optimizer)
        return self._clip_grad_norm(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``."""
        self.precision.unscale_gradients(optimizer)
        params = optimizer_parameters(optimizer)
        torch.nn.utils.clip_grad_value_(params, clip_val)

    # ---- collectives -------------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait for every rank (the default process group)."""
        if dist.is_initialized():
            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank (collective; a CPU all-reduce whatever the device)."""
        return self.rank.any_rank(flag)

    def rank_zero_first(self, local: bool = False) -> ContextManager:
        """Rank 0 (of the node if ``local``) runs the body first, then the others."""
        rank = self.local_rank if local else self.global_rank
        return collectives.first_then_others(rank == 0, self.any_rank)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return ``src``'s object on every rank (all ranks of the run: the default process group)."""
        return collectives.broadcast_object(obj, src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Stack every rank's tensors along a new first dimension (all ranks, or those of ``group``).

        With ``sync_grads`` the gathered tensor carries gradients back to each rank's input.
        """
        return collectives.all_gather(data, self.root_device, group, sync_grads)

    def all_reduce(self, data: Any, reduce_op: Any = "mean", group: Any = None) -> Any:
        """Reduce tensors (or numbers) over all ranks of the run (the default process group), or ``group``.

        Under tensor parallelism too: the ranks of one tensor-parallel group hold the same batch, so
        a mean over all ranks equals the mean over the data-parallel groups.
        """
        return collectives.all_reduce(data, reduce_op, self.root_device, group)

    # ---- checkpoints -------------------------------------------------------------------------

    #: ``"full"``: one checkpoint file written by rank 0; ``"sharded"``: a folder where each rank
    #: writes its own shard (the FSDP default). ``load`` reads both, whatever this is.
    state_dict_type: str = "full"

    def on_save(self, path: Path, handle: Any) -> None:
        """A checkpoint was saved to ``path`` (committed now, or once ``handle`` finishes): the failure
        report of this rank names the last committed one."""
        self.rank.saving(path, handle)

    def on_load(self, path: Path) -> None:
        """The run resumed from the checkpoint at ``path``."""
        self.rank.loaded(path)

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process's run writes checkpoints (False where another replica group writes them)."""
        return True

    def wrap(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` now (FSDP); other strategies return it unchanged."""
        return module
