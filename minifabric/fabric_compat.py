"""What Lightning Fabric code expects of a Fabric object, provided for an Accelerator.

- ``plugins=``: Fabric passes precision plugins, precision strings and cluster environments there;
  :func:`split_plugins` turns them into the Accelerator's own arguments.
- Lightning's loggers and rank-zero helpers read ``rank_zero_only.rank``; :func:`set_rank_zero`
  sets it when the process joins the run, as Fabric's strategies do.
- Lightning's utilities that take a Fabric (``ThroughputMonitor``) call ``fabric._validate_launched()``
  and then hand ``fabric.strategy.precision`` to lightning's precision type checks;
  :func:`present_precision_to_lightning` makes minifabric's plugin answer those checks.

lightning-fabric is imported only inside these functions, and only when the user's code already
brought it in (its import costs over a second).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from minifabric.precision import PRECISIONS, Precision
from minifabric.process import swap_class
from minifabric.resolve import canonical


def _lightning_packages() -> list[str]:
    """The lightning-fabric packages this process has imported (``lightning_fabric``, ``lightning.fabric``)."""
    return [name for name in ("lightning_fabric", "lightning.fabric") if name in sys.modules]


def _is_cluster_environment(plugin: Any) -> bool:
    for package in _lightning_packages():
        environments = sys.modules.get(f"{package}.plugins.environments")
        if environments is not None and isinstance(plugin, environments.ClusterEnvironment):
            return True
    return False


def _precision_name(plugin: Any) -> str | None:
    """The precision string of a precision plugin (minifabric's or lightning's), or None."""
    if isinstance(plugin, (str, int)) and not isinstance(plugin, bool):
        return canonical("precision", plugin)
    if isinstance(plugin, Precision):
        return plugin.name
    name = getattr(plugin, "precision", None)
    if type(plugin).__module__.startswith(
        ("lightning_fabric.plugins.precision", "lightning.fabric.plugins.precision")
    ):
        return name if isinstance(name, str) and name in PRECISIONS else None
    return None


def split_plugins(plugins: Any, precision: Any) -> tuple[Any, Any]:
    """Read Fabric's ``plugins=``: returns ``(precision, cluster_environment or None)``.

    Accepted: a precision string (``"bf16-mixed"``), a precision plugin (minifabric's or
    lightning's ``Precision``, ``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision``,
    ``FSDPPrecision``) and a lightning ``ClusterEnvironment`` (``SLURMEnvironment()``, ...). A
    precision given both here and as ``precision=`` must agree.

    Raises:
        TypeError: a plugin minifabric has no use for (checkpoint IO, quantization, ...).
        ValueError: two precisions that disagree, or two cluster environments.
    """
    items = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    environment = None
    chosen: str | None = None
    for plugin in items:
        if _is_cluster_environment(plugin):
            if environment is not None:
                raise ValueError(
                    f"plugins= holds two cluster environments, {environment!r} and {plugin!r}: pass one."
                )
            environment = plugin
            continue
        name = _precision_name(plugin)
        if name is None:
            raise TypeError(
                f"plugins= got {plugin!r}, which minifabric cannot use. It accepts a precision (a string"
                ' such as "bf16-mixed", or a precision plugin) and a cluster environment, e.g.'
                ' `Accelerator(plugins=[SLURMEnvironment()], precision="bf16-mixed")`. Checkpoint IO and'
                " quantization plugins have no equivalent here."
            )
        if chosen is not None and name != chosen:
            raise ValueError(f"plugins= holds two precisions, {chosen!r} and {name!r}: pass one.")
        chosen = name
    if chosen is None:
        return precision, environment
    if precision is not None and canonical("precision", precision, warn=False) not in ("32-true", chosen):
        raise ValueError(
            f"precision={precision!r} and plugins= (precision {chosen!r}) disagree. Pass one of them, e.g."
            f" `Accelerator(precision={chosen!r})`."
        )
    return chosen, environment


def attach_lightning_module(
    module: Any, accelerator: Any, callbacks: list[Any], optimizers: Any = None
) -> None:
    """Give a ``LightningModule`` the accelerator, as Fabric's ``setup`` does.

    A module with a ``_fabric`` attribute (lightning's ``LightningModule``) gets the accelerator
    there, so ``self.fabric``, ``self.logger`` and ``self.log`` go to the accelerator and its
    loggers; ``self.optimizers()`` returns the set-up optimizers; and the module joins the
    callbacks, so ``acc.call("on_train_epoch_end")`` reaches its hooks.
    """
    if not hasattr(module, "_fabric"):
        return
    module._fabric = accelerator
    if optimizers is not None:
        module._fabric_optimizers = list(optimizers)
    if not any(callback is module for callback in callbacks):
        callbacks.append(module)


def to_device(obj: Any, device: torch.device) -> Any:
    """``module.to(device)`` for a module; every tensor in a collection moved for anything else."""
    if isinstance(obj, torch.nn.Module):
        return obj.to(device)
    from minifabric.data import move_data_to_device

    return move_data_to_device(obj, device)


def set_rank_zero(global_rank: int) -> None:
    """Tell lightning's ``rank_zero_only`` (used by its loggers and warnings) this process's rank.

    lightning reads the rank from environment variables when it is first imported, which can be
    before the process knows it (a forked or spawned rank); Fabric's strategies set it at launch.
    """
    if "lightning_utilities" not in sys.modules and not _lightning_packages():
        return  # imported later: it reads RANK, which the launch has set by then
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = global_rank  # type: ignore[attr-defined]


def _lightning_class_name(plugin: Precision) -> str:
    if plugin.is_mixed:
        return "MixedPrecision"
    if plugin.param_dtype == torch.float64:
        return "DoublePrecision"
    if plugin.param_dtype in (torch.float16, torch.bfloat16):
        return "HalfPrecision"
    return "Precision"


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)  # type: ignore[call-overload]
    obj.__dict__.update(state)
    return obj


def present_precision_to_lightning(plugin: Precision) -> None:
    """Make ``plugin`` an instance of the matching lightning precision class too, in place.

    lightning's ``ThroughputMonitor`` asks ``isinstance(precision, MixedPrecision)`` (and the like)
    to find the compute dtype, and reads ``_desired_input_dtype``. The plugin's class becomes a
    subclass of its own class and of lightning's, with minifabric's methods first in the MRO, so
    nothing minifabric does changes. It pickles as the plain minifabric plugin.
    """
    packages = _lightning_packages()
    own = getattr(type(plugin), "_minifabric_base", type(plugin))
    wanted = _lightning_class_name(plugin)
    bases = []
    for package in packages:
        plugins_module = __import__(f"{package}.plugins", fromlist=[wanted])
        lightning_cls = getattr(plugins_module, wanted)
        if not isinstance(plugin, lightning_cls):
            bases.append(lightning_cls)
    if not bases:
        return
    plugin._desired_input_dtype = plugin.compute_dtype  # type: ignore[attr-defined]
    view = type(
        own.__name__,
        (type(plugin), *bases),
        {
            "_minifabric_base": own,
            "__module__": own.__module__,
            "__reduce__": lambda self: (_rebuild, (own, dict(self.__dict__))),
        },
    )
    swap_class(plugin, view)
