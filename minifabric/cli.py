"""The ``minifabric`` command: ``run`` starts a script's processes, ``consolidate`` merges a sharded checkpoint,
``estimate`` tells whether a model fits.

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
import sys
from collections.abc import Callable, Sequence
from typing import Any

from minifabric.resolve import CHOICES, DEFAULTS, ENV_SETTINGS, canonical, suggestion

_DESCRIPTION = """\
minifabric: run a PyTorch training loop on one device, data-parallel (DDP) or fully sharded (FSDP2).

examples:
  minifabric run --devices 2 --strategy fsdp train.py --lr 0.01
  minifabric consolidate out/checkpoint model.pt
  minifabric estimate pkg.models:make_model --strategy fsdp --world-size 8 --budget 80GiB
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
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        metavar="N",
        default=0,
        help="restart every process up to N times after one fails; the script resumes from its last"
        " checkpoint (default: 0)",
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
    formats = consolidate.add_argument_group("Hugging Face safetensors (--format safetensors)")
    formats.add_argument(
        "--format",
        choices=["torch", "safetensors"],
        default="torch",
        help="safetensors: write a Hugging Face model folder, or OUT.safetensors (default: torch)",
    )
    formats.add_argument("--dtype", help="floating dtype to write, e.g. bf16 (default: each tensor's own)")
    formats.add_argument("--strip-prefix", help="remove this prefix from every name, e.g. model.")
    formats.add_argument("--max-shard-size", help="size cap per file, e.g. 5GB (default: one file)")
    formats.add_argument("--entry", help="which model of the checkpoint (default: the only one, or model)")
    consolidate.set_defaults(handler=_consolidate)


def _add_estimate(commands: Any) -> None:
    estimate = commands.add_parser(
        "estimate",
        help="estimate per-rank memory of a model x strategy x world size x precision",
        description="Estimate the per-rank peak memory of a training step without allocating the model:"
        " it is built and run on fake tensors (a 70B config takes as long as a small one).",
    )
    estimate.add_argument(
        "model", help="a factory 'pkg.module:make_model' or a Hugging Face config.json (needs transformers)"
    )
    estimate.add_argument(
        "--kwarg", action="append", default=[], metavar="KEY=VALUE",
        help="a keyword argument for the factory, or a config field (VALUE is read as JSON if it parses)",
    )  # fmt: skip
    estimate.add_argument("--strategy", choices=("single", "ddp", "fsdp", "model_parallel"), default="fsdp")
    estimate.add_argument("--world-size", "--world_size", type=int, default=1, help="number of ranks")
    estimate.add_argument("--precision", default="32-true", help='e.g. "bf16-mixed" (default: 32-true)')
    estimate.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    estimate.add_argument(
        "--batch-shape", "--batch_shape", default="1,512", help="one rank's input shape (default: 1,512)"
    )
    estimate.add_argument(
        "--input-dtype", choices=("long", "float"), default="long", help="token ids or floats"
    )
    estimate.add_argument("--activation-checkpointing", action="store_true", help="recompute each block")
    estimate.add_argument("--budget", default=None, help='memory per device, e.g. "80GiB"')
    estimate.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks per tensor-parallel group (model_parallel)"
    )
    estimate.add_argument(
        "--parallelize", default=None, help="pkg.module:parallelize, the ModelParallelStrategy function"
    )
    estimate.set_defaults(handler=_estimate)


def _estimate(args: argparse.Namespace) -> None:
    import json

    import torch

    from minifabric.estimate import estimate_memory

    kwargs = {}
    for item in args.kwarg:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(
                f"minifabric estimate: --kwarg {item!r} must be KEY=VALUE, e.g. --kwarg n_layer=32."
            )
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    try:
        shape = tuple(int(n) for n in args.batch_shape.split(","))
    except ValueError:
        raise SystemExit(
            f"minifabric estimate: --batch-shape {args.batch_shape!r} must be ints, e.g. 8,2048."
        ) from None
    result = estimate_memory(
        args.model,
        model_kwargs=kwargs,
        strategy=args.strategy,
        world_size=args.world_size,
        precision=args.precision,
        optimizer=args.optimizer,
        batch_shape=shape,
        input_dtype=torch.long if args.input_dtype == "long" else torch.float32,
        activation_checkpointing=args.activation_checkpointing,
        budget=args.budget,
        tensor_parallel_size=args.tensor_parallel_size,
        parallelize_fn=args.parallelize,
    )
    print(result)


#: one function per subcommand, in the order ``minifabric --help`` lists them
_SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_run, _add_consolidate, _add_estimate)


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
        *([f"--max-restarts={args.max_restarts}"] if args.max_restarts else []),
        # every rank runs the script through minifabric's runner: a non-zero sys.exit is a failure
        # known at once (see minifabric/runtime/run_script.py)
        "--module",
        "minifabric.runtime.run_script",
        args.script,
        *args.script_args,
    ]


def _run(args: argparse.Namespace) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    if args.max_restarts < 0:
        raise SystemExit(f"minifabric run: --max-restarts={args.max_restarts} must be 0 or more.")

    settings = {
        "accelerator": args.accelerator,
        "strategy": args.strategy,
        "precision": args.precision,
        "devices": str(_devices_per_node(args.devices, args.accelerator)),
        "num_nodes": str(args.num_nodes),
    }
    from minifabric import process
    from minifabric.runtime.environment import available_cores

    # torchrun starts the ranks with this process's environment: the settings reach `Accelerator()` there
    values = {ENV_SETTINGS[name]: value for name, value in settings.items() if value is not None}
    threads = {"OMP_NUM_THREADS": str(max(1, available_cores() // int(settings["devices"])))}
    with process.scoped_environment(values, defaults=threads):
        try:
            torchrun_main(torchrun_args(args))
        except ChildFailedError as err:
            # Each rank has already printed why it ended (its traceback, or one line); torchrun's
            # traceback and failure table would repeat it in about 40 lines. One line, and the code.
            raise SystemExit(_failed_ranks_line(err)) from None


def _failed_ranks_line(err: Any) -> int:
    """Print which ranks failed with which exit status; return the exit code for the first one."""
    failures = sorted(err.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    ends = []
    for rank, failure in failures:
        code = failure.exitcode
        ends.append(f"rank {rank} " + (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"))
    print(f"minifabric run: {'; '.join(ends)} (each rank's own output above says why)", file=sys.stderr)
    code = failures[0][1].exitcode if failures else 1
    return 128 - code if code < 0 else (code or 1)


def _consolidate(args: argparse.Namespace) -> None:
    extra = [f"--{k.replace('_', '-')}" for k in ("dtype", "strip_prefix", "max_shard_size", "entry")
             if getattr(args, k) is not None]  # fmt: skip
    if extra and args.format != "safetensors":
        raise SystemExit(f"minifabric consolidate: {', '.join(extra)} need --format safetensors.")
    if args.format == "safetensors":
        from minifabric.checkpoint.hf import export_safetensors

        export_safetensors(args.checkpoint, args.output, entry=args.entry, dtype=args.dtype,
                           strip_prefix=args.strip_prefix, max_shard_size=args.max_shard_size)  # fmt: skip
    else:
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
    if args.command == "run":  # the script's own errors are its business
        args.handler(args)
        return
    from minifabric.checkpoint.errors import CheckpointError

    try:
        args.handler(args)
    except (CheckpointError, ValueError, TypeError, FileNotFoundError) as err:
        # A wrong path or option: the message says what and how to fix it; a traceback adds nothing.
        parser.exit(1, f"minifabric {args.command}: error: {err}\n")


if __name__ == "__main__":
    main()
