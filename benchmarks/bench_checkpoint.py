"""Checkpoint benchmark: sharded save/load throughput against the disk, and the stall of an async save.

On 2 ranks (FSDP, CPU/gloo) with a model of ~1 GB of fp32 parameters, one run measures:

1. the disk's own rate: each rank writes (with fsync) and reads back a file the size of its shard,
   at the same time, like a sharded save does (the best of two rounds);
2. ``acc.save`` of a sharded checkpoint (every byte fsynced, committed) and ``acc.load`` of it, as
   GB/s of state, and their ratio to the disk's write/read rate (target >= 0.7). The load is
   measured twice: from the page cache (the checkpoint was just written; the disk's read rate is
   then measured from the page cache too), and from the disk, after the files are dropped from the
   page cache (``posix_fadvise(DONTNEED)``) next to a cold read of the disk's own test file. A
   save that replaces the committed checkpoint is measured back to back, and with a training step
   between the saves as a loop runs them (the previous version is deleted on a background thread
   after the commit, overlapping the step; the next save waits for it). Because this kind of disk
   varies several-fold between identical fsynced writes, the steady state is also measured in
   pairs: each replacing save right after the disk writes a new file of the same size under the
   same conditions, and the median of the pairs' ratios is reported (likewise the load from the
   disk, each next to a cold read of a file of the same size);
3. the same for a checkpoint of the model and its AdamW state: the two moments per parameter are
   read into memory the process allocates for them, once right after the optimizer was created
   and once again;
4. a load that asks for none of the tensors: the bytes per rank of what it returns, against their
   full size (they come back sharded);
5. the training-loop stall of ``acc.save(..., asynchronous=True)``: the time the call takes plus the
   time the next ``optimizer.step()`` waits for the background copy of the state, against the time
   of a synchronous save of the same state (target <= 0.1). The step that overlaps the copy is
   timed too, next to an ordinary step.

Run (about 4 minutes)::

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint.py --dir /tmp/bench-ckpt --gb 1.0
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from statistics import median

import torch
from torch import nn

from minifabric import Accelerator

PAIRS = 5  # save/load measured next to the disk, as pairs


def build(acc: Accelerator, gigabytes: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(gigabytes * 2**30 / (width * width * 4)))
    with acc.init_module(empty_init=True):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return acc.setup(model, optimizer)


def evict(*paths: Path) -> None:
    """Drop the files under ``paths`` from the page cache, so the next read comes from the disk.

    Without ``posix_fadvise`` (macOS) nothing is dropped and the "from the disk" numbers are warm.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for root in paths:
        for path in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_write(acc: Accelerator, path: Path, nbytes: int) -> float:
    """Seconds for every rank to write (and fsync) ``nbytes`` into a new file at once."""
    block = os.urandom(64 * 2**20)
    acc.barrier()
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    acc.barrier()
    return time.perf_counter() - start


def disk_read(acc: Accelerator, path: Path, cold: bool) -> float:
    """Seconds for every rank to read its file at once; ``cold``: dropped from the page cache first."""
    if cold:
        evict(path)
    acc.barrier()
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 * 2**20):
            pass
    acc.barrier()
    return time.perf_counter() - start


def disk_rate(acc: Accelerator, folder: Path, nbytes: int) -> tuple[float, float, float]:
    """Aggregate GB/s of every rank writing (fsync) then reading ``nbytes`` at once: write, read, cold read."""
    path = folder / f"disk-{acc.global_rank}.bin"
    write = disk_write(acc, path, nbytes)
    reads = [disk_read(acc, path, cold) for cold in (False, True)]
    path.unlink()
    total = nbytes * acc.world_size / 1e9
    return total / write, total / reads[0], total / reads[1]


def timed(acc: Accelerator, fn) -> float:
    acc.barrier()
    start = time.perf_counter()
    fn()
    acc.barrier()
    return time.perf_counter() - start


def step(acc: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    acc.backward(model(torch.randn(2, 4096)).sum())
    optimizer.step()
    optimizer.zero_grad()


def main(acc: Accelerator, folder: str, gigabytes: float) -> dict:
    root = Path(folder)
    model, optimizer = build(acc, gigabytes)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    nbytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    total_gb = nbytes * acc.world_size / 1e9
    # The disk's best of two rounds, so that a slow first round does not flatter the ratios.
    rounds = [disk_rate(acc, root, nbytes) for _ in range(2)]
    write_gbps, read_gbps, disk_cold = (max(r[i] for r in rounds) for i in range(3))

    acc.save(root / "warmup", state)  # the first save creates the checkpoint group and its buffers
    shutil.rmtree(root / "warmup", ignore_errors=True) if acc.global_rank == 0 else None
    save = timed(acc, lambda: acc.save(root / "ckpt", state))  # a new path
    save_again = timed(acc, lambda: acc.save(root / "ckpt", state))  # replaces a committed checkpoint
    save_third = timed(acc, lambda: acc.save(root / "ckpt", state))  # and again, right away
    # A training loop runs steps between its saves: the previous version's deletion overlaps them.
    save_steady = []
    for _ in range(2):
        step(acc, model, optimizer)
        save_steady.append(timed(acc, lambda: acc.save(root / "ckpt", state)))
    # This disk's fsynced writes vary several-fold between identical calls, so the steady state is
    # also measured in pairs, each save next to the disk writing a new file of the same size under
    # the same conditions (a training step before each); the median of the pairs' ratios is reported.
    paired_save = []
    reference = root / f"paired-{acc.global_rank}.bin"
    for _ in range(PAIRS):
        step(acc, model, optimizer)
        disk_s = disk_write(acc, reference, nbytes)
        reference.unlink()  # as the save's replaced version is deleted
        step(acc, model, optimizer)
        paired_save.append(disk_s / timed(acc, lambda: acc.save(root / "ckpt", state)))
    load = timed(acc, lambda: acc.load(root / "ckpt", state))
    if acc.global_rank == 0:
        evict(root / "ckpt")
    load_cold = timed(acc, lambda: acc.load(root / "ckpt", state))
    # A load that asks for none of the tensors: what comes back is held sharded, not whole per rank.
    rest = acc.load(root / "ckpt", {"step": 0})["model"]
    rest_local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in rest.values())
    rest_whole = sum(t.numel() * t.element_size() for t in rest.values())
    del rest

    step_times = []
    for _ in range(3):
        step_times.append(timed(acc, lambda: step(acc, model, optimizer)))
    step_s = sorted(step_times)[1]
    returns, holds, first_steps, steps_during = [], [], [], 0
    for _ in range(2):  # the first allocates the staging copy, the second reuses it
        acc.barrier()
        start = time.perf_counter()
        handle = acc.save(root / "ckpt_async", state, asynchronous=True)
        returns.append(time.perf_counter() - start)
        # The copy runs in the background and the next optimizer.step() waits for it: a step
        # pre-hook registered after the save's own runs once that wait is over.
        released: list[float] = []
        hook = optimizer.register_step_pre_hook(lambda *_, out=released: out.append(time.perf_counter()))
        step_start = time.perf_counter()
        acc.backward(model(torch.randn(2, 4096)).sum())
        before_step = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        hook.remove()
        holds.append(released[0] - before_step)
        acc.barrier()
        first_steps.append(time.perf_counter() - step_start)
        steps_during += 1
        while not handle.done():
            step(acc, model, optimizer)
            steps_during += 1
        handle.wait()
        acc.barrier()
    # Model and AdamW state (two moments per parameter): the optimizer already holds its moments (a
    # run that loads a checkpoint mid-run), so they are copied into its state tensors.
    adam = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(acc, model, adam)
    adam_state = {"model": model, "optimizer": adam}
    acc.save(root / "ckpt_adam", adam_state)
    adam_gb = 3 * total_gb
    adam_load = timed(acc, lambda: acc.load(root / "ckpt_adam", adam_state))
    adam_load_again = timed(acc, lambda: acc.load(root / "ckpt_adam", adam_state))
    if acc.global_rank == 0:
        evict(root / "ckpt_adam")
    adam_load_cold = timed(acc, lambda: acc.load(root / "ckpt_adam", adam_state))
    # In pairs too: the disk's cold read of a file of this rank's share, then the cold load.
    paired_load = []
    reference = root / f"paired-{acc.global_rank}.bin"
    disk_write(acc, reference, 3 * nbytes)
    for _ in range(PAIRS):
        disk_s = disk_read(acc, reference, cold=True)
        if acc.global_rank == 0:
            evict(root / "ckpt_adam")
        paired_load.append(disk_s / timed(acc, lambda: acc.load(root / "ckpt_adam", adam_state)))
    reference.unlink()
    # A fresh optimizer without state (a restarted process): the moments land in new memory.
    fresh_state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4)}
    adam_load_fresh = timed(acc, lambda: acc.load(root / "ckpt_adam", fresh_state))
    return {
        "state_gb": total_gb,
        "disk_cold_gbps": disk_cold,
        "load_cold_gbps": total_gb / load_cold,
        "adam_gb": adam_gb,
        "adam_load_gbps": adam_gb / adam_load,
        "adam_load_again_gbps": adam_gb / adam_load_again,
        "adam_load_cold_gbps": adam_gb / adam_load_cold,
        "adam_load_fresh_gbps": adam_gb / adam_load_fresh,
        "disk_write_gbps": write_gbps,
        "disk_read_gbps": read_gbps,
        "save_s": save,
        "save_gbps": total_gb / save,
        "save_again_s": save_again,
        "save_third_s": save_third,
        "save_steady_s": sorted(save_steady)[0],
        "paired_save_ratios": paired_save,
        "paired_cold_load_ratios": paired_load,
        "load_s": load,
        "load_gbps": total_gb / load,
        "subset_local_gb": rest_local / 1e9,
        "subset_whole_gb": rest_whole / 1e9,
        "step_s": step_s,
        "async_return_s": returns[1],
        "async_hold_s": holds[1],
        "async_stall_first_s": returns[0] + holds[0],
        "async_stall_s": returns[1] + holds[1],
        "first_step_after_async_s": first_steps[1],
        "steps_during_async_write": steps_during,
        "steps_held": sum(1 for hold in holds if hold > 0.001),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/bench-ckpt", help="folder on the disk to measure")
    parser.add_argument("--gb", type=float, default=1.0, help="size of the model's fp32 parameters")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    Path(args.dir).mkdir(parents=True)
    accelerator = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    r = accelerator.launch(main, args.dir, args.gb)
    print(f"state: {r['state_gb']:.2f} GB on 2 ranks (FSDP, CPU/gloo)")
    print(
        f"disk:  write {r['disk_write_gbps']:.2f} GB/s, read {r['disk_read_gbps']:.2f} GB/s,"
        f" read from the disk (not the page cache) {r['disk_cold_gbps']:.2f} GB/s (2 ranks at once)"
    )
    save_ratio, load_ratio = r["save_gbps"] / r["disk_write_gbps"], r["load_gbps"] / r["disk_read_gbps"]
    print(
        f"save:  {r['save_s']:.2f} s = {r['save_gbps']:.2f} GB/s = {save_ratio:.2f} of the disk (target >= 0.7)"
    )
    print(
        f"       replacing that checkpoint (its old version deleted after the commit): {r['save_again_s']:.2f} s"
        f" = {r['state_gb'] / r['save_again_s'] / r['disk_write_gbps']:.2f} of the disk; replacing it again:"
        f" {r['save_third_s']:.2f} s = {r['state_gb'] / r['save_third_s'] / r['disk_write_gbps']:.2f}"
        f" (back to back)\n       replacing it with a training step between the saves (steady state, best of 2):"
        f" {r['save_steady_s']:.2f} s = {r['state_gb'] / r['save_steady_s'] / r['disk_write_gbps']:.2f}"
        " of the disk (target >= 0.8)"
    )
    print(
        f"load:  {r['load_s']:.2f} s = {r['load_gbps']:.2f} GB/s = {load_ratio:.2f} of the disk (target >= 0.7)"
    )
    print(
        f"       from the disk (shards evicted from the page cache): {r['load_cold_gbps']:.2f} GB/s"
        f" = {r['load_cold_gbps'] / r['disk_cold_gbps']:.2f} of the disk's {r['disk_cold_gbps']:.2f} GB/s"
    )
    print(
        f"       model + AdamW state ({r['adam_gb']:.2f} GB), copied into the optimizer's moments:"
        f" {r['adam_load_gbps']:.2f} GB/s = {r['adam_load_gbps'] / r['disk_read_gbps']:.2f} of the disk"
        f" (target >= 0.9; loaded again: {r['adam_load_again_gbps'] / r['disk_read_gbps']:.2f});"
        f" from the disk {r['adam_load_cold_gbps'] / r['disk_cold_gbps']:.2f} of it"
    )
    print(
        f"       paired with the disk under the same conditions ({PAIRS} pairs, median of the ratios):"
        f" replacing save with a step between {median(r['paired_save_ratios']):.2f} of the disk's write"
        f" (target >= 0.8; pairs {', '.join(f'{x:.2f}' for x in r['paired_save_ratios'])}),"
        f" model + AdamW load from the disk {median(r['paired_cold_load_ratios']):.2f} of its cold read"
        f" (target >= 0.9; pairs {', '.join(f'{x:.2f}' for x in r['paired_cold_load_ratios'])})"
    )
    print(
        f"       the same into a fresh optimizer (moments into new memory):"
        f" {r['adam_load_fresh_gbps'] / r['disk_read_gbps']:.2f} of the disk"
    )
    print(
        f"subset load: entries not asked for are held {r['subset_local_gb']:.2f} GB per rank"
        f" of {r['subset_whole_gb']:.2f} GB whole"
    )
    print(
        f"async: the loop stalls {r['async_stall_s']:.3f} s = {r['async_stall_s'] / r['save_s']:.3f} of a sync save"
        f" (target <= 0.1): the call returns in {r['async_return_s']:.3f} s, the next optimizer.step() waits"
        f" {r['async_hold_s']:.3f} s for the copy (first async save, which allocates the copy's buffers:"
        f" {r['async_stall_first_s']:.3f} s in all)"
    )
    print(
        f"       the step overlapping the copy took {r['first_step_after_async_s']:.2f} s, an ordinary step"
        f" {r['step_s']:.2f} s; {r['steps_during_async_write']} steps ran while the two saves wrote;"
        f" {r['steps_held']} of the 2 first steps waited for the copy"
    )
    shutil.rmtree(args.dir, ignore_errors=True)
