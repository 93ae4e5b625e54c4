"""Start-up cost: ``import minifabric`` against ``import torch``, each in a fresh interpreter.

Usage (from the repository root)::

    python benchmarks/bench_import.py            # 7 alternating rounds
    python benchmarks/bench_import.py --rounds 15

Reports the median wall time of each import over the rounds (fresh processes, alternating, so
a busy machine slows both alike) and the difference; also what ``import minifabric`` pulls in that
``import torch`` does not (lightning-fabric, FSDP, DTensor must not be among them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TIMED = "import sys, time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
_HEAVY = (
    "lightning_fabric",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
)


def time_import(module: str) -> float:
    """Seconds to import ``module`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _TIMED.format(module=module)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def heavy_modules_imported() -> list[str]:
    """The heavy modules present in ``sys.modules`` after ``import minifabric``."""
    code = f"import sys, minifabric; print(' '.join(m for m in {_HEAVY!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    time_import("torch")  # warm the file cache
    torch_s, minifabric_s = [], []
    for _ in range(args.rounds):
        torch_s.append(time_import("torch"))
        minifabric_s.append(time_import("minifabric"))
    t, m = statistics.median(torch_s), statistics.median(minifabric_s)
    print(f"import torch:      median {t:.3f} s  ({', '.join(f'{x:.2f}' for x in torch_s)})")
    print(f"import minifabric: median {m:.3f} s  ({', '.join(f'{x:.2f}' for x in minifabric_s)})")
    print(f"minifabric - torch: {m - t:+.3f} s (target <= +0.3 s)")
    print(f"heavy modules after import minifabric: {heavy_modules_imported() or 'none'}")


if __name__ == "__main__":
    main()
