"""Every code block in README.md and docs/*.md is run, so the docs cannot drift from the code.

How a block is treated is decided by its fence's info string (GitHub highlights by the first word
only, so the rest does not show when rendered):

- ```` ```python ````: run as a script (``python snippet.py``) in the document's scratch folder.
  A script may start more processes with ``acc.launch()``; it must finish within ``timeout=S``
  (default 120 s).
- ```` ```python file=NAME ````: written to ``NAME`` in the scratch folder, not run; a later block
  of the same document runs it (e.g. ``minifabric run --devices 2 NAME``).
- ```` ```bash run ```` (or ``sh``/``console``): run with ``bash -euo pipefail`` in the scratch
  folder, where ``python`` runs this interpreter (in its virtual environment, if any) and ``examples/`` points at the repository's.
- ```` ```bash skip="REASON" ````: not run; the reason is required and says why (installs
  packages, needs a cluster, takes minutes).
- ```` ```yaml file=NAME ````: a configuration file (e.g. a Kubernetes manifest), written to ``NAME``
  in the scratch folder for a later block to check or use; ``file=`` is required.
- ```` ```text ```` and ```` ```mermaid ````: output and diagrams, not code.

Blocks of one document share one scratch folder and run in order, so a later block can load the
checkpoint an earlier one saved. Any other info string fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import REPO, run_command

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("**/*.md")])
SHELLS = {"bash", "sh", "shell", "console"}
NOT_CODE = {"text", "mermaid"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    options: dict[str, str] = field(default_factory=dict)
    code: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their info-string options."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match["fence"], match["info"].strip()
        words = shlex.split(info) if info else []
        lang = words[0].lower() if words else ""
        options = {}
        for word in words[1:]:
            key, _, value = word.partition("=")
            options[key] = value
        body = []
        start = i + 1  # 1-based line of the opening fence
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(
                lines[i][len(match["indent"]) :] if lines[i].startswith(match["indent"]) else lines[i]
            )
            i += 1
        blocks.append(Block(path, start, lang, options, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _check(block: Block) -> str | None:
    """Why this block's info string is not allowed, or None."""
    if block.lang in NOT_CODE:
        return None
    if block.lang == "python":
        unknown = set(block.options) - {"file", "timeout"}
        return f"unknown options {sorted(unknown)}" if unknown else None
    if block.lang == "yaml":
        return None if set(block.options) == {"file"} else "yaml blocks need file=NAME (and nothing else)"
    if block.lang in SHELLS:
        if "skip" in block.options:
            return None if block.options["skip"].strip() else 'skip needs a reason: skip="why it is not run"'
        if "run" in block.options:
            unknown = set(block.options) - {"run", "timeout"}
            return f"unknown options {sorted(unknown)}" if unknown else None
        return 'shell blocks must say `run` or `skip="reason"`'
    return (
        f"info string {block.lang!r} is neither python, a shell ({sorted(SHELLS)}), yaml file=NAME"
        f" nor {sorted(NOT_CODE)}"
    )


def test_docs_exist():
    assert (REPO / "README.md").is_file()
    assert len(DOCS) > 1, "docs/ has no Markdown files"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_is_run_or_exempt(path: Path):
    problems = [f"{b.where}: {why}" for b in parse_blocks(path) if (why := _check(b))]
    assert not problems, "\n".join(problems)


def _environment(scratch: Path) -> dict[str, str]:
    bin_dir = scratch / ".bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    if not python.exists():
        # A wrapper, not a symlink: a symlink to a virtual environment's interpreter starts Python
        # outside that environment (its pyvenv.cfg is looked up next to the link), without torch.
        python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        python.chmod(0o755)
    examples = scratch / "examples"
    if not examples.exists():
        examples.symlink_to(REPO / "examples")
    scripts = str(Path(sys.executable).parent)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        "MPLBACKEND": "Agg",
    }


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_code_blocks_run(path: Path, tmp_path: Path):
    blocks = [b for b in parse_blocks(path) if _check(b) is None and b.lang not in NOT_CODE]
    env = _environment(tmp_path)
    for n, block in enumerate(blocks):
        timeout = float(block.options.get("timeout") or 120)
        if block.lang in ("python", "yaml") and "file" in block.options:
            (tmp_path / block.options["file"]).write_text(block.code)
            continue
        if block.lang == "python":
            script = tmp_path / f"snippet_{n}.py"
            script.write_text(block.code)
            cmd = [sys.executable, script.name]
        elif "run" in block.options:
            cmd = ["bash", "-euo", "pipefail", "-c", block.code]
        else:
            continue  # skip="reason", checked by test_every_block_is_run_or_exempt
        try:
            result = run_command(cmd, timeout=timeout, cwd=tmp_path, env=env)
        except Exception as err:  # subprocess.TimeoutExpired
            pytest.fail(f"{block.where} did not finish: {err}\n--- code ---\n{block.code}")
        if result.returncode != 0:
            pytest.fail(
                f"{block.where} failed with exit code {result.returncode}\n--- code ---\n{block.code}"
                f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"
            )
