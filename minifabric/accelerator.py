"""The Accelerator: one object that owns a launcher, a precision plugin and a strategy.

It validates input at the public call and delegates; behaviour that differs between strategies
lives in the strategy, never here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from minifabric import _arguments, fabric_compat
from minifabric._torch import split_compiled
from minifabric.callbacks import as_list, call_hook, check_loggers, first_logger, log_metrics
from minifabric.data import _WrappedDataLoader, setup_dataloader
from minifabric.precision import Precision, PrecisionInput
from minifabric.resolve import AcceleratorStr, StrategyStr, apply_cli_settings, launched_by_cli, resolve
from minifabric.runtime.rank import end
from minifabric.seed import seed_everything as _seed_everything
from minifabric.strategies.rebind import OrphanWatch, SetupLedger, parameters_before
from minifabric.strategies.strategy import Strategy
from minifabric.wrappers import _WrappedModule, _WrappedOptimizer

if TYPE_CHECKING:
    from minifabric.checkpoint.hf import KeyMap
    from minifabric.checkpoint.service import Checkpointer


class Accelerator:
    """Run a raw PyTorch training loop on one device, data-parallel, or fully sharded.

    Args:
        accelerator: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.
        strategy: ``"auto"`` (one device: ``"single"``, more: ``"ddp"``), ``"single"``, ``"ddp"``,
            ``"fsdp"``, ``"fsdp_cpu_offload"``, or a [`Strategy`][minifabric.Strategy] instance.
        devices: processes per node: an int, ``"auto"``, or a list of CUDA device indices.
        num_nodes: number of machines.
        precision: ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"``, ``"16-true"``.
            Strings are read in any case, with Lightning Fabric's aliases (``16``, ``"bf16"``, ``32``, ...).
        plugins: as in Fabric: a precision (string or plugin) and/or a lightning ``ClusterEnvironment``.
        callbacks: objects whose methods :meth:`call` invokes by name.
        loggers: loggers with ``log_metrics(metrics, step)`` (lightning-fabric's ``CSVLogger``,
            ``TensorBoardLogger``, or your own); :meth:`log` writes to them from global rank 0.

    Example:
        >>> import torch
        >>> from minifabric import Accelerator
        >>> acc = Accelerator(accelerator="cpu", devices=1)
        >>> acc.launch()
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = acc.setup(model, optimizer)
        >>> loss = model(torch.randn(8, 4, device=acc.device)).sum()
        >>> acc.backward(loss)
        >>> optimizer.step()
    """

    def __init__(
        self,
        accelerator: AcceleratorStr = "auto",
        strategy: StrategyStr | Strategy = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int = 1,
        precision: PrecisionInput = "32-true",
        plugins: Any = None,
        callbacks: Any = None,
        loggers: Any = None,
    ) -> None:
        precision, environment = fabric_compat.split_plugins(plugins, precision)
        self._callbacks = as_list(callbacks, "callbacks")
        self._loggers = as_list(loggers, "loggers")
        check_loggers(self._loggers)
        settings = apply_cli_settings(
            accelerator=accelerator,
            strategy=strategy,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
        )
        parts = resolve(**settings, environment=environment)
        self._strategy = parts.strategy
        self._launched = False
        self._ledger = SetupLedger()  # the models set up, for optimizers set up after them
        # raises at step() of an optimizer left holding parameters that setup replaced
        self._orphans = OrphanWatch(owner=self)
        if launched_by_cli():  # as under `fabric run`: the script's own torch.distributed calls work
            self._join()

    # ---- properties --------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes."""
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        """Rank of this process's node."""
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self._strategy.is_global_zero

    @property
    def strategy(self) -> Strategy:
        """The strategy in use."""
        return self._strategy

    @property
    def precision(self) -> Precision:
        """The precision plugin in use."""
        return self._strategy.precision

    @property
    def should_stop(self) -> bool:
        """True on every rank, at the same read, once any rank got SIGTERM or SIGUSR1: save and exit.

        Schedulers send these before preempting a job (SLURM ``--signal``, Kubernetes). With several
        processes, reading this property is a collective (one all-reduce of a single integer on a
        small gloo group): every rank must read it at the same point of the loop, e.g. once per
        step, as every rank calls ``all_reduce`` at the same point. It is the only communication of
        the stop agreement: ``optimizer.step()`` stays local. The signal handlers are installed at
        ``launch``; once the loop has read this property, a first signal only sets the flag (a
        second one ends the process); a script that never reads it keeps the signals' default
        action.

        Inside a Ray Train worker (Ray Train v2, a function run by ``TorchTrainer.fit()``), it is
        also True once Ray reports that a node of the run is being preempted: every read calls
        ``ray.train.get_preemption_info()`` exactly once on every rank (Ray's own collective, so
        a loop that also calls it itself must do so as often on every rank). Under Ray Train v1
        and outside Ray nothing more is read, and ray is not imported.

        Example:
            >>> from minifabric import Accelerator
            >>> acc = Accelerator(accelerator="cpu")
            >>> acc.should_stop
            False
        """
        return self._strategy.should_stop

    # ---- launching ---------------------------------------------------------------------------

    def launch(self, function: Callable[..., Any] | None = None, *args: Any) -> Any:
        """Start the other processes (or join them) and set up the process group.

        ``launch()`` re-runs the current script once per extra local process, the way torchrun does.
        ``launch(fn, *args)`` instead spawns fresh processes that each call ``fn(acc, *args)`` and
        returns rank 0's result; ``fn`` must be importable (defined at module level) and the script
        needs an ``if __name__ == "__main__":`` guard. Under torchrun, SLURM, LSF or MPI the processes
        exist already and ``launch`` only joins them.

        Example:
            >>> from minifabric import Accelerator
            >>> Accelerator(accelerator="cpu").launch(lambda acc: acc.world_size)
            1
        """
        _arguments.check_launch_function(function, args, self._strategy.spawn_only and not launched_by_cli())
        if self._launched:  # joined already (a second call, or under `minifabric run`)
            if function is None or launched_by_cli():  # as in Fabric, launching again is a no-op
                return function(self, *args) if function is not None else None
            raise RuntimeError("`acc.launch(fn)` after `acc.launch()`: the processes exist, call `fn(acc)`.")
        target = _arguments.CallWithAccelerator(self, function) if function is not None else None
        return self._strategy.launcher.launch(self._join, target, *args)

    def _join(self) -> None:
        if self._launched:
            return
        self._strategy.setup_environment()
        fabric_compat.set_rank_zero(self.global_rank)
        self._launched = True

    def _validate_launched(self) -> None:
        # Lightning's utilities that take a Fabric (ThroughputMonitor) call this first, then read
        # `strategy.precision` through lightning's precision classes.
        self._ensure_launched()
        fabric_compat.present_precision_to_lightning(self.precision)

    def _ensure_launched(self) -> None:
        if self._launched:
            return
        if self._strategy.launcher.creates_processes:
            raise RuntimeError(_arguments.launch_needed(self._strategy.num_processes))
        self._join()

    # ---- models ------------------------------------------------------------------------------

    @contextmanager
    def init_module(
        self, empty_init: bool | None = None, *, verify: bool | None = None
    ) -> Generator[None, None, None]:
        """Build a model inside this context: on the device, in the precision's dtype.

        With ``empty_init=True`` parameters are created on the meta device (no memory) and the
        init ``__init__`` applies to them is recorded; ``setup`` materializes them (under FSDP only
        each rank's shard) with the values eager construction with the same seed gives, whatever
        the strategy and world size. May be entered any number of times, before or after other
        models' ``setup``. See docs/meta-init.md for what is recorded and what is refused.

        Args:
            empty_init: create parameters on the meta device and initialize them at ``setup``.
            verify: with ``empty_init=True``, rank 0 also builds each model eagerly on the CPU at
                ``setup`` and compares every tensor and the random stream, raising on the first
                difference. Default: ``MINIFABRIC_VERIFY_INIT=1`` in the environment. Use it once,
                when model code is new or changed.

        Example:
            >>> import torch
            >>> from minifabric import Accelerator
            >>> acc = Accelerator(accelerator="cpu")
            >>> with acc.init_module(empty_init=True):
            ...     model = torch.nn.Linear(4, 4)
            >>> model.weight.is_meta
            True
            >>> model = acc.setup(model)
            >>> model.weight.is_meta
            False
        """
        checking = _arguments.check_init_module_arguments(empty_init, verify)
        self._ensure_launched()
        with self._strategy.module_init_context(empty_init, verify=checking):
            yield

    @contextmanager
    def init_tensor(self) -> Generator[None, None, None]:
        """Tensors created inside land on ``acc.device`` in the precision's dtype."""
        with self.precision.tensor_init_context(), self.device:
            yield

    def setup(self, module: nn.Module, *optimizers: Optimizer, scheduler: Any = None) -> Any:
        """Set up a model and its optimizers; returns ``(model, *optimizers)`` (and the scheduler).

        The model is moved to the device, converted to the precision and wrapped (DDP) or sharded
        (FSDP). Optimizers built before ``setup`` (even over meta parameters) are rebound to the
        new parameters. A scheduler passed here is pointed at the returned optimizer.

        Args:
            module: the model.
            *optimizers: its optimizers, built before or after the model was created.
            scheduler: an LR scheduler of the first optimizer, returned last.

        Returns:
            The model, or ``(model, *optimizers)``, or ``(model, *optimizers, scheduler)``.

        Raises:
            RuntimeError: the model was already set up, or ``launch`` is needed first.
            ValueError: an optimizer holds parameters of no model set up here.

        Example:
            >>> import torch
            >>> from minifabric import Accelerator
            >>> acc = Accelerator(accelerator="cpu")
            >>> model = torch.nn.Linear(2, 2)
            >>> opt = torch.optim.AdamW(model.parameters())
            >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
            >>> model, opt, sched = acc.setup(model, opt, scheduler=sched)
        """
        model = self.setup_module(module)
        if not optimizers:
            _arguments.check_scheduler(scheduler)
            self.call("on_after_setup", fabric=self, module=model)
            return model
        self._ledger.check_owned(optimizers, model.module)  # type: ignore[arg-type]
        wrapped = self.setup_optimizers(*optimizers)
        wrapped = list(wrapped) if isinstance(wrapped, (list, tuple)) else [wrapped]
        fabric_compat.attach_lightning_module(model.module, self, self._callbacks, wrapped)
        self.call("on_after_setup", fabric=self, module=model)  # Fabric's hook, after setup(model, opt)
        if scheduler is not None:
            _arguments.point_scheduler_at(scheduler, wrapped[0])
            self._strategy.setup_scheduler(scheduler)
            return (model, *wrapped, scheduler)
        return (model, *wrapped)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Set up only the model (see [`setup`][minifabric.Accelerator.setup]).

        Args:
            module: the model.

        Returns:
            The set-up model: call it like the original; ``.module`` is the original module.
        """
        _arguments.check_module(module)
        self._ensure_launched()
        compiled, module = module, split_compiled(module)[0]  # the strategy re-applies the compile
        forward_module = self._ledger.forward_module(module)
        if (
            forward_module is None
        ):  # else set up again, as Fabric allows: the same placed model, a new wrapper
            before = parameters_before(module)
            with self._orphans.watch(module):
                forward_module = self._strategy.setup_module(compiled)
            self._ledger.record(before, module, forward_module)
        fabric_compat.attach_lightning_module(module, self, self._callbacks)
        return _WrappedModule(forward_module, module, self._strategy)

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Set up optimizers whose model was set up with [`setup_module`][minifabric.Accelerator.setup_module].

        Args:
            *optimizers: optimizers over the parameters of models already set up (or of their
                originals: they are rebound to the parameters ``setup`` produced).

        Returns:
            One optimizer, or a tuple of them.
        """
        _arguments.check_optimizers(optimizers)
        wrapped = []
        for optimizer in optimizers:
            self._ledger.rebind(optimizer)
            wrapped.append(
                _WrappedOptimizer(self._strategy.setup_optimizer(optimizer), self._strategy, self._callbacks)
            )
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def setup_dataloaders(
        self, *dataloaders: DataLoader, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Give each rank its part of every epoch and move batches to ``acc.device``.

        The returned loaders set the sampler's epoch on every new pass and can be saved in a
        checkpoint to resume mid-epoch.

        Args:
            *dataloaders: the loaders.
            use_distributed_sampler: give each rank its own part of the data (a ``DistributedSampler``).
            move_to_device: move every batch to ``acc.device``.

        Returns:
            One loader, or a tuple of them.
        """
        _arguments.check_dataloaders(dataloaders)
        self._ensure_launched()
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # set by any seed_everything, as in Fabric
        split = self._strategy.distributed_sampler_kwargs  # the data-parallel ranks
        out = [
            _WrappedDataLoader(
                setup_dataloader(loader, use_distributed_sampler, split["num_replicas"], split["rank"], seed),
                self.device if move_to_device else None,
            )
            for loader in dataloaders
        ]
        for loader in out:
            self._strategy.setup_dataloader(loader)
        return out[0] if len(out) == 1 else tuple(out)

    # ---- the step ----------------------------------------------------------------------------

    def backward(
        self, tensor: torch.Tensor, *args: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        """``tensor.backward()`` through the precision plugin (loss scaling for ``"16-mixed"``).

        Use it instead of ``loss.backward()``: under ``"16-mixed"`` a step after a plain
        ``loss.backward()`` raises.

        Args:
            tensor: the loss.
            *args: passed to ``tensor.backward``.
            model: the model the loss came from, when several are set up.
            **kwargs: passed to ``tensor.backward``.
        """
        module = model.module if isinstance(model, _WrappedModule) else model
        self._strategy.backward(tensor, module, *args, **kwargs)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip gradients by value (``clip_val``) or by total norm (``max_norm``); returns the total norm.

        The signature is Lightning Fabric's: ``clip_gradients(model, optimizer, 0.5)`` clips by value.
        The norm is taken over all shards: the number a single process would compute.

        Args:
            module: the set-up model.
            optimizer: its set-up optimizer (its gradients are unscaled first under ``"16-mixed"``).
            clip_val: clip every gradient element to ``[-clip_val, clip_val]``.
            max_norm: clip so that the total norm is at most this.
            norm_type: the p of the p-norm (``float("inf")`` for the max norm).
            error_if_nonfinite: with ``max_norm``, raise if the total norm is NaN or infinite (the
                gradients are left as they were); ``False`` scales them by the non-finite norm.

        Returns:
            The total norm before clipping (with ``max_norm``), else None.

        Raises:
            ValueError: both or neither of ``max_norm`` and ``clip_val`` were given.
            RuntimeError: the total norm is not finite and ``error_if_nonfinite`` is True (on every rank).
        """
        _arguments.check_clip(clip_val, max_norm)
        forward_module = module._forward_module if isinstance(module, _WrappedModule) else module
        opt = optimizer.optimizer if isinstance(optimizer, _WrappedOptimizer) else optimizer
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                forward_module, opt, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        self._strategy.clip_gradients_value(forward_module, opt, clip_val)  # type: ignore[arg-type]
        return None

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Any:
        """Context manager: no gradient communication inside (for gradient accumulation).

        Args:
            module: the model ``setup`` returned.
            enabled: ``False`` turns it into a no-op (the last micro-batch, which synchronizes).
        """
        if not isinstance(module, _WrappedModule):
            raise TypeError(
                f"`no_backward_sync` needs the model returned by `acc.setup`, got {type(module).__name__}:"
                " `model = acc.setup(model)` first."
            )
        return self._strategy.no_backward_sync(module._forward_module, enabled)

    def autocast(self) -> Any:
        """The precision's forward context, for work outside ``model.forward``."""
        return self.precision.forward_context()

    # ---- checkpoints -------------------------------------------------------------------------

    @cached_property
    def _checkpointer(self) -> Checkpointer:
        from minifabric.checkpoint.service import Checkpointer  # imports DTensor: only when checkpointing

        return Checkpointer(end_process=end)  # a background save that failed unseen ends the rank

    def save(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
        *,
        asynchronous: bool = False,
        format: Literal["minifabric", "safetensors"] = "minifabric",
        keep_last: int | None = None,
    ) -> Any:
        """Save ``state`` (modules, optimizers, stateful objects, tensors, plain values) to ``path``.

        Call on every rank. Under FSDP this writes a sharded checkpoint folder by default. Until it
        completes, ``path`` still holds the previous checkpoint. With ``asynchronous=True`` returns a
        handle with ``.wait()`` and training may continue while the files are written.

        Args:
            path: a file (one-file checkpoints) or a folder (sharded, the default under FSDP).
            state: names to modules, optimizers, objects with ``state_dict()``, tensors and plain values.
            filter: as in Lightning Fabric: entry name -> ``(key, value) -> bool``; only the items of
                that entry's state dict for which it returns True are saved.
            asynchronous: write in the background.
            keep_last: once this checkpoint is committed, keep only the K newest of its series (siblings
                named alike but for their digits, e.g. ``step-000100``); see ``latest_checkpoint``.

            format: ``"safetensors"`` writes the one model in ``state`` as a Hugging Face model folder
                (``config.json`` and ``model.safetensors``; rank 0 writes, one tensor at a time).

        Returns:
            With ``asynchronous=True``, a handle whose ``.wait()`` blocks until the save is committed.
        """
        _arguments.check_state(state, keep_last)
        if (module := _arguments.safetensors_module(state, format, asynchronous)) is not None:
            return self._checkpointer.export_safetensors(Path(path), module)
        if not self._strategy.writes_checkpoints:  # another replica group writes this checkpoint
            from minifabric.checkpoint.service import SaveHandle

            return SaveHandle(Path(path)) if asynchronous else None
        unwrapped, options = _arguments.unwrap_state(state), self._strategy.state_dict_type
        handle = self._checkpointer.save(
            Path(path), unwrapped, options, asynchronous=asynchronous, keep_last=keep_last, filter=filter
        )
        self._strategy.on_save(Path(path), handle)  # named in a failure report
        return handle

    def load(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from the checkpoint at ``path``; return what ``state`` did not ask for.

        Modules, optimizers and stateful objects are loaded in place; plain values are copied back into
        ``state``. With ``state=None`` everything is returned.

        Args:
            path: a checkpoint written by ``save`` (any world size, sharded or one file).
            state: what to restore, keyed as when saving.
            strict: raise on missing or unexpected keys (``False``: warn and load what matches).
            weights_only: ``False`` lets a one-file checkpoint unpickle arbitrary classes, which runs
                code from the file: only for files you trust. ``None`` (default) and ``True`` never do.

        Returns:
            The checkpoint's entries that ``state`` did not ask for.

        Raises:
            CheckpointError: no checkpoint at ``path``, an interrupted save, or keys and shapes that
                do not match.
        """
        if state is None:
            state = {}
        _arguments.check_state(state)
        before = _arguments.unwrap_state(state)
        unwrapped = dict(before)  # modules and optimizers load in place; other values are replaced
        remainder = self._checkpointer.load(Path(path), unwrapped, strict=strict, weights_only=weights_only)
        self._strategy.on_load(Path(path))
        state.update({key: value for key, value in unwrapped.items() if value is not before[key]})
        return remainder

    def load_raw(
        self,
        path: str | os.PathLike,
        obj: nn.Module | Optimizer,
        strict: bool = True,
        *,
        key_map: KeyMap | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Load a plain ``torch.save(model.state_dict())`` file, a consolidated checkpoint, or Hugging Face
        safetensors (a ``.safetensors`` file or a ``save_pretrained`` folder) into ``obj``.

        Args:
            path: the file, or a folder holding ``model.safetensors`` or ``model.safetensors.index.json``.
            obj: a module or optimizer (set up; safetensors load into modules only).
            strict: raise on missing or unexpected keys.
            key_map: renames the safetensors' tensors to the model's names: a dict
                ``{"file.name": "model.name"}`` (other names unchanged) or a function (None skips a tensor).
            weights_only: ``False`` lets a ``torch.save`` file unpickle arbitrary classes (runs code from
                the file: only for files you trust); ``None`` (default) and ``True`` never do.

        Under FSDP each rank reads only its shard of the safetensors, straight into its parameters.
        """
        target = _arguments.unwrap_state({"obj": obj})["obj"]
        if not isinstance(target, (nn.Module, Optimizer)):
            raise TypeError(f"`load_raw` loads into a module or optimizer, got {type(obj).__name__}.")
        modules = self._ledger.modules()  # they name an optimizer's parameters
        self._checkpointer.load_raw(
            Path(path), target, strict=strict, key_map=key_map, weights_only=weights_only, modules=modules
        )

    # ---- collectives and utilities -----------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank gets here (``name`` is accepted for Fabric scripts and unused)."""
        self._ensure_launched()
        self._strategy.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank ``src`` to all ranks and return it."""
        self._ensure_launched()
        return self._strategy.broadcast(obj, src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Gather tensors (or collections of them) from every rank, stacked on a new first dimension.

        As in Fabric, with one process the tensors come back as they are (no new dimension).

        Args:
            data: a tensor, number, or a collection of them; the same shapes on every rank.
            group: a ``torch.distributed`` process group to gather over (default: all ranks); call it
                on the group's ranks only.
            sync_grads: keep the result in the autograd graph (a contrastive loss over the whole
                batch): the gradients of each rank's slice flow back to that rank's tensor.

        Raises:
            ValueError: on every rank, when the ranks pass tensors of different shapes or dtypes.
        """
        self._ensure_launched()
        return self._strategy.all_gather(data, group=group, sync_grads=sync_grads)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce tensors over all ranks (``"mean"``, ``"sum"``, ``"max"``, ``"min"``), in place.

        As in Fabric, every tensor in ``data`` receives the result and is returned (numbers come
        back as new tensors). The arguments are Fabric's, in its order: pass ``reduce_op`` by name.

        Args:
            data: a tensor, number, or a collection of them; the same shapes and dtypes on every rank.
            group: a ``torch.distributed`` process group to reduce over (default: all ranks).
            reduce_op: the reduction, a name or a ``torch.distributed.ReduceOp`` (SUM, AVG, MAX, MIN).

        Raises:
            TypeError: ``"mean"`` of an integer tensor (the mean cannot be stored in it), or a
                ``group`` that is not a process group (``acc.all_reduce(x, "sum")``).
            ValueError: on every rank, when the ranks pass tensors of different shapes or dtypes
                (the tensors are left unchanged).
        """
        self._ensure_launched()
        return self._strategy.all_reduce(data, reduce_op=reduce_op, group=group)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed python, numpy (if installed) and torch on this rank; also seeds data shuffling.

        A staticmethod, as in Fabric: ``Accelerator.seed_everything(3)`` works without an instance.
        With ``seed=None`` the seed comes from ``PL_GLOBAL_SEED`` (default 0). ``workers`` (default
        True) seeds dataloader workers too; ``verbose`` is accepted for Fabric scripts.
        """
        return _seed_everything(seed, workers=True if workers is None else workers)

    def rank_zero_first(self, local: bool = False) -> ContextManager:
        """Rank 0 (of the node if ``local``) runs the body first, then the others.

        If the body raises on rank 0, the waiting ranks raise ``PeerFailed`` instead of waiting.
        """
        return self._strategy.rank_zero_first(local)

    # ---- loggers, callbacks ------------------------------------------------------------------

    @property
    def loggers(self) -> list[Any]:
        """The loggers passed as ``Accelerator(loggers=...)``."""
        return self._loggers

    @property
    def logger(self) -> Any:
        """The first logger (the main one).

        Raises:
            RuntimeError: no logger was passed to the Accelerator.
        """
        return first_logger(self._loggers)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one scalar to every logger, from global rank 0 (other ranks do nothing).

        Args:
            name: the metric's name.
            value: a number or a one-element tensor (detached and turned into a number).
            step: the step to log at; loggers count steps themselves when it is None.
        """
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Log several scalars to every logger, from global rank 0 (other ranks do nothing).

        Args:
            metrics: names to numbers or one-element tensors.
            step: the step to log at; loggers count steps themselves when it is None.

        Raises:
            TypeError: ``metrics`` is not a mapping.
            ValueError: a tensor with more than one element.
        """
        log_metrics(self._loggers, self.is_global_zero, metrics, step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name(*args, **kwargs)`` on every callback that has that method, in order.

        Keyword arguments a callback's method does not take are left out, as in Fabric.

        Args:
            hook_name: the method to call, e.g. ``"on_train_epoch_end"``.
            *args: passed to every hook.
            **kwargs: passed to the hooks that take them.

        Example:
            >>> from minifabric import Accelerator
            >>> class Printer:
            ...     def on_epoch_end(self, epoch):
            ...         print("epoch", epoch)
            >>> Accelerator(accelerator="cpu", callbacks=[Printer()]).call("on_epoch_end", epoch=1, loss=0.5)
            epoch 1
        """
        call_hook(self._callbacks, hook_name, *args, **kwargs)

    def to_device(self, obj: Any) -> Any:
        """Move a module, a tensor or a collection of tensors to ``acc.device``; returns it."""
        return fabric_compat.to_device(obj, self.device)
