"""The checkpoint phase of the GPU card (``bench_gpu.py``): save and load rates against raw DCP, and the
time an asynchronous save costs the training loop. See ``bench_gpu.py`` for how to run it."""

from __future__ import annotations

import functools
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from minifabric import Accelerator

ASYNC_SAVES = 3  # the first pays for the staging buffers; the third shows the steady state


def measure_checkpoints(bench: Any, acc: Accelerator, model: nn.Module, optimizer: Any, step: Callable[[], None]) -> dict[str, Any]:
    """Save/load rates against raw DCP and the async-save loss, for a set-up model whose AdamW state exists.

    ``bench`` gives ``timed(fn)``, ``sync()``, ``dir`` (where checkpoints go) and ``size["ckpt_rounds"]``;
    ``step()`` runs one training step of ``model``.
    """
    state = {"model": model, "optimizer": optimizer}
    inner, inner_opt = model.module, optimizer.optimizer

    def raw_state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(inner, inner_opt)
        return {"model": model_sd, "optimizer": optim_sd}

    def local_bytes(tree: Any) -> int:
        if isinstance(tree, dict):
            return sum(local_bytes(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(local_bytes(v) for v in tree)
        if isinstance(tree, torch.Tensor):
            local = tree.to_local() if isinstance(tree, DTensor) else tree
            return local.numel() * local.element_size()
        return 0

    def raw_load(path: Path) -> None:
        loaded = raw_state()
        dcp.load(loaded, checkpoint_id=str(path))
        set_state_dict(inner, inner_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    nbytes = local_bytes(raw_state())
    saves: dict[str, list[float]] = {"minifabric": [], "raw_dcp": []}
    loads: dict[str, list[float]] = {"minifabric": [], "raw_dcp": []}
    for r in range(bench.size["ckpt_rounds"]):
        paths = {"minifabric": bench.dir / f"mf-{r}", "raw_dcp": bench.dir / f"dcp-{r}"}
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        save = {"minifabric": lambda p: acc.save(p, state), "raw_dcp": lambda p: dcp.save(raw_state(), checkpoint_id=str(p))}
        load = {"minifabric": lambda p: acc.load(p, state), "raw_dcp": raw_load}
        for name in order:
            saves[name].append(bench.timed(functools.partial(save[name], paths[name])))
        for name in order:
            loads[name].append(bench.timed(functools.partial(load[name], paths[name])))
        for path in paths.values():
            shutil.rmtree(path)
    sync_save = statistics.median(saves["minifabric"])

    normal = statistics.median(bench.timed(step) for _ in range(5))
    asynchronous = []
    for i in range(ASYNC_SAVES):
        path = bench.dir / f"async-{i}"
        bench.sync()
        start = time.perf_counter()
        handle = acc.save(path, state, asynchronous=True)
        bench.sync()
        blocking = time.perf_counter() - start
        extra, steps = 0.0, 0
        while steps < 2 or (not handle.done() and steps < 10_000):
            extra += bench.timed(step) - normal
            steps += 1
        waited = bench.timed(handle.wait)
        lost = blocking + extra + waited
        asynchronous.append({"blocking_s": blocking, "extra_step_s": extra, "steps_overlapped": steps,
                             "wait_s": waited, "lost_s": lost, "lost_over_sync_save": lost / sync_save,
                             "bytes_by_route": dict(getattr(handle, "staged", {}))})  # fmt: skip
        shutil.rmtree(path)
        for _ in range(2):
            step()
    gb = nbytes / 1e9
    return {
        "state_bytes": nbytes,
        "save_gb_per_s": {name: gb / statistics.median(t) for name, t in saves.items()},
        "load_gb_per_s": {name: gb / statistics.median(t) for name, t in loads.items()},
        "save_minifabric_over_raw_dcp_rate": statistics.median(s2 / s1 for s1, s2 in zip(saves["minifabric"], saves["raw_dcp"], strict=True)),
        "load_minifabric_over_raw_dcp_rate": statistics.median(s2 / s1 for s1, s2 in zip(loads["minifabric"], loads["raw_dcp"], strict=True)),
        "sync_save_s": sync_save,
        "normal_step_s": normal,
        "async_first": asynchronous[0],
        "async_steady": asynchronous[2],
        "async_all": asynchronous,
        "per_round_s": {"save": saves, "load": loads},
        "note": "loads read the files just written (page cache); the state is the model and its AdamW state",
    }  # fmt: skip
