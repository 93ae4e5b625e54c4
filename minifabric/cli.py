"""The ``minifabric`` command: ``run`` starts a script's processes, ``consolidate`` merges a sharded checkpoint.

``minifabric run`` is a thin layer over ``torch.distributed.run`` (torchrun): it starts
``--devices`` processes on this node, joins ``--num-nodes`` nodes through torchrun's rendezvous at
``--main-address:--main-port``, and passes ``--accelerator``, ``--strategy``, ``--precision``,
``--devices`` and ``--num-nodes`` to the script's ``Accelerator()`` through environment variables.

Each subcommand is one ``_add_<name>(commands)`` function that adds its parser and sets
``handler``, the function `main` calls with the parsed arguments; a new subcommand is one
more such function listed in ``_SUBCOMMANDS``. Help texts are plain words: argparse prints them as
they are.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from minifabric.resolve import CHOICES, DEFAULTS, ENV_SETTINGS, canonical, suggestion

_DESCRIPTION = """\
minifabric: run a PyTorch training loop on one device, data-parallel (DDP) or fully sharded (FSDP2).

examples:
  minifabric run --devices 2 --strategy fsdp train.py --lr 0.01
  minifabric consolidate out/checkpoint model.pt
  minifabric run --help            (every option of a command)
"""


def _choice(name: str) -> Callable[[str], str]:
    """An argparse ``type`` that reads a value the way ``Accelerator(name=...)`` does."""

    def parse(value: str) -> str:
        try:
            return canonical(name, value, warn=False)
        except ValueError:
            hint = suggestion(name, value)
            raise argparse.ArgumentTypeError(
                f"unknown value {value!r}{f'; did you mean {hint}?' if hint else '.'}"
                f" Choose one of: {', '.join(CHOICES[name])}."
            ) from None

    parse.__name__ = name  # argparse names the type in its error messages
    return parse


def _add_run(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="start a training script on one or more processes",
        description="Start a training script on this node's processes (on top of torchrun). The"
        " script's Accelerator() takes --accelerator, --strategy, --precision, --devices and"
        " --num-nodes from here unless the script passes them itself.",
    )
    run.add_argument(
        "--devices", default="1", metavar="N", help='processes on this node: an int or "auto" (default: 1)'
    )
    run.add_argument(
        "--num-nodes", "--num_nodes", type=int, metavar="N", default=1, help="number of nodes (default: 1)"
    )
    run.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        metavar="R",
        default=0,
        help="rank of this node, 0 to N-1 (default: 0)",
    )
    run.add_argument(
        "--main-address",
        "--main_address",
        metavar="HOST",
        default="127.0.0.1",
        help="address of node 0 (default: 127.0.0.1)",
    )
    run.add_argument(
        "--main-port",
        "--main_port",
        type=int,
        metavar="PORT",
        default=29400,
        help="free port on node 0 (default: 29400)",
    )
    for name, also in (
        ("accelerator", ""),
        ("strategy", ""),
        ("precision", ", or Fabric's 16, 32, 64, bf16"),
    ):
        run.add_argument(
            f"--{name}",
            type=_choice(name),
            default=None,
            metavar="NAME",
            help=f"one of {', '.join(CHOICES[name])}{also}, in any case"
            f" (default: what the script passes, else {DEFAULTS[name]})",
        )
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    run.set_defaults(handler=_run)


def _add_consolidate(commands: Any) -> None:
    consolidate = commands.add_parser(
        "consolidate",
        help="merge a sharded checkpoint into one file",
        description="Merge a sharded checkpoint folder (written under FSDP) into one file that"
        " torch.load(path, weights_only=True) reads. Runs in one process.",
    )
    consolidate.add_argument("checkpoint", help="the sharded checkpoint folder")
    consolidate.add_argument("output", help="the file to write")
    consolidate.set_defaults(handler=_consolidate)


#: one function per subcommand, in the order ``minifabric --help`` lists them
_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_run, _add_consolidate]


def _version() -> str:
    import torch

    import minifabric

    return f"minifabric {minifabric.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minifabric", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(commands)
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
    """The ``torch.distributed.run`` command line for ``minifabric run``'s flags.

    Args:
        args: the parsed flags of ``minifabric run``.

    Returns:
        The arguments for ``torch.distributed.run.main``.
    """
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


def _consolidate(args: argparse.Namespace) -> None:
    from minifabric.checkpoint.consolidate import consolidate

    consolidate(args.checkpoint, args.output)
    print(f"wrote {args.output}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``minifabric`` command (and of ``python -m minifabric``).

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv``.

    Without a command it prints the help and exits with status 2.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        raise SystemExit(2)
    args.handler(args)


if __name__ == "__main__":
    main()
