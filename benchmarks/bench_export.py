"""Export benchmark: peak memory of turning a sharded checkpoint into Hugging Face safetensors.

A model of ``--layers`` square ``--width`` linear layers (fp32) is saved as a sharded checkpoint by 2
FSDP ranks; then one fresh process exports it (``export_safetensors``, the code behind
``minifabric consolidate CKPT OUT --format safetensors``) and reports its peak RSS above the RSS it
had before the export began, next to the model's size and its largest tensor. An export that
streams tensor by tensor stays near one tensor; one that loads the model stays above its size.

Run (about a minute; ~400 MB model)::

    MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072 OMP_NUM_THREADS=1 \\
        python benchmarks/bench_export.py --dir /tmp/bench-export --layers 24 --width 2048

``python benchmarks/bench_export.py measure CKPT OUT`` runs only the export and prints its numbers
as JSON (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from minifabric import Accelerator


def _status(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak) of this process, in bytes.

    ``VmHWM`` rather than ``ru_maxrss``: the latter keeps the peak of the process that forked this
    one (from before ``exec``), so a big parent would inflate it.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def save(acc: Accelerator, folder: str, layers: int, width: int) -> None:
    """Build the model on meta, set it up on the ranks and save a sharded checkpoint (every rank)."""
    with acc.init_module(empty_init=True):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = acc.setup(model)
    acc.save(folder, {"model": model})


def measure(checkpoint: str, output: str) -> dict:
    """Export ``checkpoint`` to ``output`` in this process; its peak RSS above the RSS before, and sizes."""
    from minifabric.checkpoint.hf import export_safetensors
    from minifabric.checkpoint.read import open_checkpoint

    tree = open_checkpoint(Path(checkpoint)).tree["model"]
    sizes = [torch.Size(ref["shape"]).numel() * 4 for ref in tree.values()]
    before = _status("VmRSS")
    start = time.perf_counter()
    export_safetensors(checkpoint, output)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"rss_before": before, "peak_above_before": peak - before, "model_bytes": sum(sizes),
            "largest_tensor_bytes": max(sizes), "seconds": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="all", choices=["all", "save", "measure"])
    parser.add_argument("paths", nargs="*", help="measure: CKPT OUT")
    parser.add_argument("--dir", default="/tmp/bench-export")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    if args.mode == "measure":
        print(json.dumps(measure(*args.paths)))
        return
    root = Path(args.dir)
    if args.mode == "save":  # on each of the 2 ranks that `minifabric run` starts
        acc = Accelerator()
        acc.launch()
        save(acc, str(root / "ckpt"), args.layers, args.width)
        return
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "minifabric", "run", "--devices", "2", "--accelerator", "cpu", "--strategy",
         "fsdp", __file__, "save", "--dir", str(root), "--layers", str(args.layers), "--width", str(args.width)],
        check=True,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, __file__, "measure", str(root / "ckpt"), str(root / "export")],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    mib = 2**20
    print(
        f"model {result['model_bytes'] / mib:.0f} MiB, largest tensor {result['largest_tensor_bytes'] / mib:.0f} MiB;"
        f" export peak RSS above its start {result['peak_above_before'] / mib:.0f} MiB"
        f" ({result['peak_above_before'] / result['largest_tensor_bytes']:.2f}x the largest tensor,"
        f" {result['peak_above_before'] / result['model_bytes']:.2f}x the model), {result['seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()
