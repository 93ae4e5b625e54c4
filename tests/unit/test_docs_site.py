"""The documentation site (MkDocs, Material, mkdocstrings) builds with ``--strict``.

A broken link between pages, a broken cross-reference in a docstring, or a docstring mkdocstrings
cannot read fails here, as does a public name without a docstring. Skipped only where mkdocs is
not installed (``pip install -e ".[dev]"`` installs it).
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import REPO, run_command

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("material")

#: Sphinx roles render as literal text in mkdocstrings; use `name` or [`name`][minifabric.name]
_RST_ROLE = re.compile(r":(class|meth|func|attr|mod|obj|exc):`")


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = run_command(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        timeout=240,
        cwd=REPO,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    reference = (site / "reference" / "index.html").read_text()
    import minifabric

    for name in minifabric.__all__:
        assert f'id="minifabric.{name}"' in reference, f"minifabric.{name} is missing from the API reference"
    text = re.sub(r"<[^>]+>", "", reference)
    roles = sorted({m.group(0) for m in _RST_ROLE.finditer(text)})
    assert not roles, f"reST roles {roles} in docstrings render as text; write [`name`][minifabric.name]"


def _documented_in_a_base(cls, method: str) -> bool:
    """An override that its base class documents (``MixedPrecision.pre_backward`` by ``Precision``)."""
    return any(base.members.get(method) is not None and base.members[method].docstring for base in cls.mro())


def test_every_public_name_has_a_docstring():
    griffe = pytest.importorskip("griffe")
    package = griffe.load("minifabric", search_paths=[str(REPO)], resolve_aliases=True)
    exported = {name: package.members[name] for name in package.exports or []}
    missing = []
    for name, member in exported.items():
        target = member.final_target if member.is_alias else member
        if not target.docstring:
            missing.append(name)
        if target.kind.value == "class":
            for sub, m in target.all_members.items():
                if sub.startswith("_") or m.kind.value != "function" or m.docstring:
                    continue
                if not _documented_in_a_base(target, sub):
                    missing.append(f"{name}.{sub}")
    assert not missing, f"public names without a docstring: {missing}"


def test_quickstart_section_2_changes_the_constructor_only():
    from tests.unit.test_docs import parse_blocks

    one, two = [
        b.code.splitlines() for b in parse_blocks(REPO / "docs" / "quickstart.md") if b.lang == "python"
    ][:2]
    changed = [(a, b) for a, b in zip(one, two, strict=True) if a != b]
    assert len(one) == len(two) and len(changed) == 1, changed
    assert changed[0][1].startswith("acc = Accelerator(") and 'strategy="fsdp"' in changed[0][1]
