"""README.md's benchmark table, generated from the measured results in ``benchmarks/results.json``.

Usage (from the repository root)::

    python benchmarks/table.py                          # rewrite README.md's table from results.json
    python benchmarks/table.py --check                  # exit 1 if README.md's table is not what it would write
    python benchmarks/table.py --gpu-card gpu-card.json # merge a bench_gpu.py card into results.json, then rewrite

Each row of ``results.json`` holds the measurement's name, the values as measured, where it was
measured (``machine``), the command that measures it, and the heading of the section of
``benchmarks/README.md`` with the details. Its ``result`` is a template: ``{name:spec}`` formats
``values[name]`` with a format spec; a list of values (runs, rounds) prints as ``min-max``; a spec
ending in ``k`` prints thousands (``76k``); ``None`` prints ``n/a``. Rows are grouped into one table
per machine, in the order of their first row. The table sits between the two marker comments of
README.md and nothing outside them is touched.

``--gpu-card`` turns a card written by ``benchmarks/bench_gpu.py --out`` into GPU rows named after
the card's device (``gpu_rows``): each replaces the row with the same key measured on the same
device, a new device gets rows of its own, and a phase the card lacks leaves that row as it was.
A ``--tiny`` dry run or a card with a failed phase is refused, and nothing is written.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import string
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
README = ROOT / "README.md"
DETAILS = ROOT / "benchmarks" / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
ROW_KEYS = ("key", "measurement", "result", "values", "machine", "command", "section")
GPU_SECTION = "The GPU card (`bench_gpu.py`)"
GPU_COMMAND = "python benchmarks/bench_gpu.py --out gpu-card.json --peak-tflops 989"


class _Formatter(string.Formatter):
    """``str.format`` over a row's values: lists as ``min-max``, ``k`` for thousands, ``None`` as n/a."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, list):
            low, high = (self.format_field(v, format_spec) for v in (min(value), max(value)))
            return low if low == high else f"{low} to {high}" if min(value) < 0 else f"{low}-{high}"
        if value is None:
            return "n/a"
        if format_spec.endswith("k"):
            return format(value / 1000, format_spec[:-1]) + "k"
        return format(value, format_spec)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(details: str) -> dict[str, str]:
    """Each heading of ``benchmarks/README.md`` and its anchor (a repeated heading gets ``-1``, ``-2``)."""
    found: dict[str, str] = {}
    seen: dict[str, int] = {}
    prose = re.sub(
        r"^(```|~~~).*?^\1", "", details, flags=re.MULTILINE | re.DOTALL
    )  # a "# comment" in a fence
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", prose, flags=re.MULTILINE):
        base = slug(match[1])
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.setdefault(match[1].strip(), base if n == 0 else f"{base}-{n}")
    return found


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_row(row: Any) -> None:
    """Raise ``ValueError`` naming the row and the field if ``row`` is not a complete results row."""
    if not isinstance(row, dict) or any(
        not isinstance(row.get(k), dict if k == "values" else str) for k in ROW_KEYS
    ):
        raise ValueError(f"results row {row!r} needs the string fields {[k for k in ROW_KEYS if k != 'values']}"
                         " and a 'values' object")  # fmt: skip
    for name, value in row["values"].items():
        if not (
            value is None
            or _number(value)
            or (isinstance(value, list) and value and all(map(_number, value)))
        ):
            raise ValueError(f"results row {row['key']!r}: values[{name!r}] = {value!r} is not a number,"
                             " a non-empty list of numbers or null")  # fmt: skip


def render_result(row: dict[str, Any]) -> str:
    """The row's ``result`` template filled with its values."""
    try:
        return _Formatter().format(row["result"], **row["values"])
    except (KeyError, IndexError, ValueError, TypeError) as err:
        raise ValueError(f"results row {row['key']!r}: its result {row['result']!r} cannot be formatted"
                         f" from values {row['values']!r} ({type(err).__name__}: {err})") from err  # fmt: skip


def _script(command: str) -> str:
    """``bench_fsdp.py step`` from ``OMP_NUM_THREADS=1 python benchmarks/bench_fsdp.py step --rounds 6``."""
    words = [w for w in command.split() if "=" not in w and w != "python"]
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    if script is None:
        raise ValueError(f"command {command!r} runs no benchmarks/*.py script")
    rest = words[script + 1 :]
    positional = rest[: next((i for i, w in enumerate(rest) if w.startswith("-")), len(rest))]
    return " ".join([Path(words[script]).name, *positional])


def render(results: dict[str, Any], details: str) -> str:
    """The Markdown that goes between README.md's markers: one table per machine."""
    headings = anchors(details)
    groups: dict[str, list[str]] = {}
    for row in results["rows"]:
        check_row(row)
        if row["section"] not in headings:
            raise ValueError(f"results row {row['key']!r}: section {row['section']!r} is not a heading of"
                             f" benchmarks/README.md (headings: {sorted(headings)})")  # fmt: skip
        link = f"[`{_script(row['command'])}`](benchmarks/README.md#{headings[row['section']]})"
        cells = (row["measurement"], render_result(row), link)
        groups.setdefault(row["machine"], []).append(
            "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
        )
    parts = [f"Measured on {machine}:\n\n| measurement | result | details |\n|---|---|---|\n" + "\n".join(lines)
             for machine, lines in groups.items()]  # fmt: skip
    return "\n\n".join(parts)


def rewrite(readme: str, table: str) -> str:
    """``readme`` with the text between its two markers replaced by ``table``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(
            f"README.md needs exactly one {START} followed by one {END} around the benchmark table"
        )
    head, rest = readme.split(START)
    return f"{head}{START}\n{table}\n{END}{rest.split(END)[1]}"


def gpu_rows(card: dict[str, Any], card_name: str = "gpu-card.json") -> list[dict[str, Any]]:
    """The GPU rows of a card written by ``bench_gpu.py --out``, one set per phase the card holds.

    Raises ``ValueError`` for a ``--tiny`` dry run, a card without a device, a failed phase, or a card
    with no phase at all: none of them is a GPU measurement.
    """
    if not isinstance(card, dict) or not isinstance(card.get("device"), str) or "torch" not in card:
        raise ValueError(f"{card_name} is not a bench_gpu.py card (it has no 'device' and 'torch')")
    if card.get("tiny") or card["device"] == "cpu":
        raise ValueError(f"{card_name} is a --tiny CPU dry run, not a GPU measurement: merge the card of"
                         f" `{GPU_COMMAND}` run on the GPU")  # fmt: skip
    failed = {
        name: phase["error"] for name, phase in card.items() if isinstance(phase, dict) and "error" in phase
    }
    if failed:
        raise ValueError(f"{card_name}: phases {sorted(failed)} failed ({failed}); rerun them"
                         f" (`{GPU_COMMAND} --phases {' '.join(sorted(failed))}`) or merge a card without them")  # fmt: skip
    try:
        return _card_rows(card, card_name)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{card_name} lacks {err} (or has it of another type), which bench_gpu.py writes:"
                         " rerun the card with this tree's bench_gpu.py") from err  # fmt: skip


def _card_rows(card: dict[str, Any], card_name: str) -> list[dict[str, Any]]:
    model = card["model"]
    machine = (f"one {card['device']}, torch {card['torch']}, world size 1 (`{card_name}`: a {model['params'] / 1e9:.2f}B"
               f" GPT, {model['n_layer']} blocks, d={model['n_embd']}, sequence {model['block_size']}, batch {model['batch']},"
               f" {card['precision']})")  # fmt: skip
    common = {"machine": machine, "command": GPU_COMMAND, "section": GPU_SECTION, "device": card["device"],
              "torch": card["torch"], "card": card_name}  # fmt: skip
    rows = []
    for phase, how in (("step_eager", "eager"), ("step_compiled", "each block compiled")):
        if (data := card.get(phase)) is not None:
            ratio, ours = data["minifabric_over_fsdp2_by_hand"], data["minifabric"]
            rows.append({"key": f"gpu_{phase}", "measurement": f'step time, `strategy="fsdp"` / hand-written FSDP2 loop, {how}',
                         "values": {"ratio": ratio["median"], "rounds": ratio["per_round"], "tokens_per_s": ours["tokens_per_s"],
                                    "mfu": ours["mfu"], "peak_tflops": card["peak_tflops"], "peak_memory": data["peak_memory_ratio"]},
                         "result": "{ratio:.3f} (median; rounds {rounds:.3f}); {tokens_per_s:.0fk} tokens/s, MFU {mfu:.2f}"
                                   " of {peak_tflops:.0f} TFLOP/s; peak memory / the hand-written loop's {peak_memory:.2f}",
                         **common})  # fmt: skip
    if (data := card.get("single")) is not None:
        ratio = data["minifabric_over_autocast_by_hand"]
        rows.append({"key": "gpu_single", "measurement": 'step time, `strategy="single"` / plain `torch.autocast` loop',
                     "values": {"ratio": ratio["median"], "rounds": ratio["per_round"]},
                     "result": "{ratio:.3f} (median; rounds {rounds:.3f})", **common})  # fmt: skip
    if (data := card.get("init")) is not None:
        rows.append({"key": "gpu_init", "measurement": "`init_module(empty_init=True)` + `setup` / the Fabric-torchtitan pattern"
                     " (meta build, `fully_shard`, `to_empty`, `reset_parameters()` on the device)",
                     "values": {"ratio": data["minifabric_meta_over_torchtitan_pattern"]["median"],
                                "minifabric_s": data["median_s"]["minifabric_meta"],
                                "pattern_s": data["median_s"]["torchtitan_pattern"],
                                "eager_s": data["median_s"]["eager_then_setup"]},
                     "result": "{ratio:.2f} ({minifabric_s:.2f} s against {pattern_s:.2f} s); eager construction on the"
                               " device + `setup` {eager_s:.2f} s", **common})  # fmt: skip
    if (data := card.get("checkpoint")) is not None:
        rows.append({"key": "gpu_async_save", "measurement": "async save of model + AdamW: time the loop loses / synchronous save",
                     "values": {"first": data["async_first"]["lost_over_sync_save"],
                                "steady": data["async_steady"]["lost_over_sync_save"],
                                "sync_s": data["sync_save_s"], "state_gb": data["state_bytes"] / 1e9},
                     "result": "{first:.3f} at the first save, {steady:.3f} at the third (synchronous save {sync_s:.2f} s"
                               " of {state_gb:.2f} GB)", **common})  # fmt: skip
        rows.append({"key": "gpu_save_load", "measurement": "save and load of model + AdamW, GB/s, minifabric / raw DCP",
                     "values": {"save": data["save_gb_per_s"]["minifabric"], "raw_save": data["save_gb_per_s"]["raw_dcp"],
                                "save_ratio": data["save_minifabric_over_raw_dcp_rate"],
                                "load": data["load_gb_per_s"]["minifabric"], "raw_load": data["load_gb_per_s"]["raw_dcp"],
                                "load_ratio": data["load_minifabric_over_raw_dcp_rate"]},
                     "result": "save {save:.2f} / {raw_save:.2f} GB/s = {save_ratio:.2f}; load (page cache) {load:.2f} /"
                               " {raw_load:.2f} GB/s = {load_ratio:.2f}", **common})  # fmt: skip
    if not rows:
        raise ValueError(
            f"{card_name} holds none of the phases init, step_eager, step_compiled, single, checkpoint"
        )
    return rows


def merge(results: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``results`` with each GPU row replacing the row of the same key on the same device (else added
    after that device's last row, or at the end for a new device)."""
    merged = [dict(r) for r in results["rows"]]
    for row in rows:
        same = [i for i, r in enumerate(merged) if r.get("device") == row["device"]]
        hit = next((i for i in same if merged[i]["key"] == row["key"]), None)
        if hit is not None:
            merged[hit] = row
        else:
            merged.insert(same[-1] + 1 if same else len(merged), row)
    return {**results, "rows": merged}


def main(argv: list[str] | None = None) -> int:
    """Rewrite README.md's table (or check it, or merge a GPU card first); 1 if ``--check`` finds it stale."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if README.md's table differs; write nothing"
    )
    parser.add_argument(
        "--gpu-card", type=Path, help="a card from bench_gpu.py --out to merge into results.json"
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument(
        "--details", type=Path, default=DETAILS, help="benchmarks/README.md, whose headings rows name"
    )
    args = parser.parse_args(argv)
    if args.check and args.gpu_card:
        parser.error("--check writes nothing: run --gpu-card without it")
    results = json.loads(args.results.read_text())
    if args.gpu_card:
        results = merge(results, gpu_rows(json.loads(args.gpu_card.read_text()), args.gpu_card.name))
    readme = args.readme.read_text()
    new = rewrite(readme, render(results, args.details.read_text()))  # every check before anything is written
    if args.check:
        if new == readme:
            return 0
        diff = difflib.unified_diff(
            readme.splitlines(), new.splitlines(), "README.md", "generated", lineterm=""
        )
        print("README.md's benchmark table is not what benchmarks/table.py writes from results.json;"
              " run `python benchmarks/table.py`:\n" + "\n".join(diff), file=sys.stderr)  # fmt: skip
        return 1
    if args.gpu_card:
        args.results.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:  # a refused card or a broken row: the message says which and what to do
        sys.exit(f"benchmarks/table.py: {err}")
