"""Runs a training script as one rank: ``python -m minifabric.runtime.run_script script.py [args]`` (or ``-m module``).

The launchers start every rank through this runner instead of ``python script.py`` so that a rank
that ends with ``sys.exit(code)`` (or ``raise SystemExit(code)``) with a non-zero code is known as
a failure at once: it leaves without waiting for the other ranks at exit, and the launcher stops
them. It also installs the Ctrl-C handling before the script starts importing.
"""

from __future__ import annotations

import os
import runpy
import sys

from minifabric import process
from minifabric.runtime import rank as this_rank


def main() -> None:
    """Run the script named on the command line as ``__main__``."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m minifabric.runtime.run_script script.py [args] | -m module [args]")
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
    this_rank.install_signals(int(rank) if rank is not None else None)
    try:
        if sys.argv[1] == "-m":
            module = sys.argv[2]
            sys.argv = [sys.argv[2], *sys.argv[3:]]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = sys.argv[1:]
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as end:
        if end.code in (None, 0):
            raise
        if not isinstance(end.code, int):
            process.write_stderr(f"{end.code}\n")  # sys.exit("message"), as Python prints it
        this_rank.end(end.code if isinstance(end.code, int) else 1)


if __name__ == "__main__":
    main()
