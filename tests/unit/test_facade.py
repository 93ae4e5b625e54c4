"""The facade only delegates: ``minifabric/accelerator.py`` read as code (its AST and tokens)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import minifabric

SOURCE = Path(minifabric.__file__).parent / "accelerator.py"
MAX_CODE_LINES = 300


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))  # type: ignore[operator]
    return lines


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - _docstring_lines(ast.parse(source)))


def test_the_counter_counts_code_only():
    source = '"""Doc."""\n\n# comment\nimport os\n\n\ndef f():\n    """Doc\n    more."""\n    return (\n        1\n    )\n'
    assert code_lines(source) == 5  # import, def, return, 1, )


def test_accelerator_py_holds_at_most_300_lines_of_code():
    count = code_lines(SOURCE.read_text())
    assert count <= MAX_CODE_LINES, (
        f"accelerator.py has {count} lines of code (docstrings apart); keep it <= 300"
    )


def _tree() -> ast.Module:
    return ast.parse(SOURCE.read_text())


def test_the_facade_never_branches_on_the_strategy_type():
    strategy_names = {
        "Strategy",
        "SingleDeviceStrategy",
        "DDPStrategy",
        "FSDPStrategy",
        "ModelParallelStrategy",
    }
    for node in ast.walk(_tree()):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            assert not names & strategy_names, ast.unparse(node)


def test_the_facade_imports_only_the_checkpoint_service():
    tree = _tree()
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minifabric.checkpoint"):
            if id(node) not in typing_only:
                assert node.module == "minifabric.checkpoint.service", ast.unparse(node)


def test_the_facade_does_not_reach_through_the_strategy_to_its_rank():
    for node in ast.walk(_tree()):
        if isinstance(node, ast.Attribute) and node.attr == "rank":
            raise AssertionError(
                f"accelerator.py reads `{ast.unparse(node)}`: give the strategy a hook instead"
            )
