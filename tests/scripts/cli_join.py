"""Started by ``fabric run`` or ``minifabric run`` with 2 processes: no ``launch()`` call.

    fabric run --accelerator cpu --devices 2 tests/scripts/cli_join.py lightning OUT_DIR
    minifabric run --accelerator cpu --devices 2 tests/scripts/cli_join.py minifabric OUT_DIR

As under ``fabric run``, the constructor joins the process group, so the script's own
``torch.distributed`` calls work right after it. Each rank writes ``OUT_DIR/rank-R.json``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if sys.argv[1] == "minifabric":
    from minifabric import Accelerator as Fabric
else:
    from lightning_fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2)
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
result = {"initialized": dist.is_initialized(), "world": fabric.world_size, "sum": value.item()}
Path(sys.argv[2], f"rank-{fabric.global_rank}.json").write_text(json.dumps(result))
if sys.argv[1] == "lightning":
    # Lightning's ranks exit with their gloo group alive, and torch then sometimes aborts at
    # interpreter exit ("terminate called without an active exception"). Destroying it right after
    # a collective can deadlock instead (gloo's worker thread needs the GIL to free the finished
    # work). The reference leaves the group the way minifabric does: collect, barrier, destroy.
    from minifabric.runtime.environment import destroy_process_group

    destroy_process_group()
