"""``examples/gpt/train.py --help`` documents every flag: a help line and its default."""

from __future__ import annotations

import re
import sys

from tests.helpers import REPO, run_command


def test_every_flag_has_a_help_line_and_a_default():
    result = run_command([sys.executable, str(REPO / "examples" / "gpt" / "train.py"), "--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    options = result.stdout.split("options:", 1)[1]
    # one entry per flag: "  --name METAVAR   help text (default: x)", possibly wrapped
    entries = [e for e in re.split(r"\n  (?=-)", options) if e.strip() and not e.lstrip().startswith("-h")]
    assert len(entries) >= 20, entries
    for entry in entries:
        flag = entry.split()[0]
        text = " ".join(entry.split())
        assert "(default:" in text, f"{flag} shows no default"
        described = re.sub(r"^\S+( [A-Z_]+)?", "", text).split("(default:")[0].strip()
        assert described, f"{flag} has no help line"
