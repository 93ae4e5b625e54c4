"""The ``minifabric`` command: ``run`` starts a script's processes, ``consolidate`` merges a sharded checkpoint.

``minifabric run`` is a thin layer over ``torch.distributed.run`` (torchrun): it starts
``--devices`` processes on this node, joins ``--num-nodes`` nodes through torchrun's rendezvous at
``--main-address:--main-port``, and passes ``--accelerator``, ``--strategy``, ``--precision``,
``--devices`` and ``--num-nodes`` to the script's ``Accelerator()`` through environment variables.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from minifabric.precision import PRECISIONS
from minifabric.resolve import ACCELERATORS, ENV_SETTINGS, STRATEGIES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minifabric", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start a training script on one or more processes")
    run.add_argument("--devices", default="1", help='processes per node: an int or "auto" (default: 1)')
    run.add_argument("--num-nodes", "--num_nodes", type=int, default=1, help="number of nodes (default: 1)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=0, help="rank of this node (default: 0)")
    run.add_argument("--main-address", "--main_address", default="127.0.0.1", help="address of node 0")
    run.add_argument(
        "--main-port", "--main_port", type=int, default=29400, help="port on node 0 (default: 29400)"
    )
    run.add_argument("--accelerator", choices=ACCELERATORS, default=None)
    run.add_argument("--strategy", choices=STRATEGIES, default=None)
    run.add_argument("--precision", choices=PRECISIONS, default=None)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    consolidate = commands.add_parser("consolidate", help="merge a sharded checkpoint into one file")
    consolidate.add_argument("checkpoint", help="the sharded checkpoint folder")
    consolidate.add_argument("output", help="the file to write (loads with torch.load(weights_only=True))")
    return parser


def _devices_per_node(devices: str, accelerator: str | None) -> int:
    if devices.isdigit() and int(devices) >= 1:
        return int(devices)
    if devices == "auto":
        import torch

        if accelerator != "cpu" and torch.cuda.is_available():
            return torch.cuda.device_count()
        return 1
    raise SystemExit(f'minifabric run: --devices={devices!r} must be a positive int or "auto".')


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The ``torch.distributed.run`` command line for ``minifabric run``'s flags."""
    nproc = _devices_per_node(args.devices, args.accelerator)
    return [
        f"--nproc-per-node={nproc}",
        f"--nnodes={args.num_nodes}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={args.main_address}",
        f"--master-port={args.main_port}",
        args.script,
        *args.script_args,
    ]


def _run(args: argparse.Namespace) -> None:
    from torch.distributed.run import main as torchrun_main

    settings = {
        "accelerator": args.accelerator,
        "strategy": args.strategy,
        "precision": args.precision,
        "devices": str(_devices_per_node(args.devices, args.accelerator)),
        "num_nodes": str(args.num_nodes),
    }
    for name, value in settings.items():
        if value is not None:
            os.environ[ENV_SETTINGS[name]] = value
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun_main(torchrun_args(args))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``minifabric`` command."""
    args = _parser().parse_args(argv)
    if args.command == "run":
        _run(args)
    else:
        from minifabric.checkpoint.consolidate import consolidate

        consolidate(args.checkpoint, args.output)
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
