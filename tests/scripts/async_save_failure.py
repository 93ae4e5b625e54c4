"""Two FSDP ranks whose background save fails, for tests/distributed/test_checkpoint_background.py.

    python tests/scripts/async_save_failure.py MODE OUT [DEVICES]

Runs under ``"fsdp"`` on DEVICES processes (default 2); the last rank fails. Modes:
``write_at_exit`` (rank 1's shard write fails, disk full, and the script ends right after
``acc.save(..., asynchronous=True)``), ``copy`` (rank 1's CPU copy fails, host memory exhausted;
every rank waits for the handle and prints ``RESULT {json}``), ``copy_at_exit`` (as ``copy``, the
script ending right after the save).
"""

import errno
import json
import sys
import time

import torch

import minifabric.checkpoint.service as service
import minifabric.checkpoint.writer as writer
from minifabric import Accelerator

mode, out = sys.argv[1], sys.argv[2]
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=devices)
acc.launch()
model = acc.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
if acc.global_rank == acc.world_size - 1:
    if mode == "write_at_exit":

        def disk_full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        writer.save_without_crc32 = disk_full
    else:

        def exhausted(*args, **kwargs):
            raise MemoryError("host memory exhausted while copying")

        service.stage = exhausted
handle = acc.save(f"{out}/ckpt", {"model": model}, asynchronous=True)
if mode == "copy":
    start = time.monotonic()
    try:
        handle.wait()
        error = "none"
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    seconds = time.monotonic() - start
    # one write of the whole line: the ranks share one unbuffered pipe, and print() writes the
    # text and its newline separately, so two ranks' lines could interleave
    sys.stdout.write(
        "RESULT " + json.dumps({"rank": acc.global_rank, "error": error, "seconds": seconds}) + "\n"
    )
    sys.stdout.flush()
