"""The parts of minifabric import only downward, and no module imports itself through others (no cycle).

Read from the source (AST): every ``import`` and ``from ... import`` of a minifabric module, also
inside functions (an import deferred for speed still ties the two modules), except under
``if TYPE_CHECKING:``, which never runs. The parts, top to bottom, are :data:`LAYERS` (the house
rules of ``docs/internals.md``); a module may import its own part or the parts below it, and
``checkpoint/`` imports neither ``strategies/`` nor the runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minifabric"

#: the parts, top to bottom, by module name (a name covers its submodules)
LAYERS = (
    ("cli", ("minifabric", "minifabric.__main__", "minifabric.cli")),
    (
        "facade",
        (
            "minifabric.accelerator",
            "minifabric._arguments",
            "minifabric.wrappers",
            "minifabric.resolve",
            "minifabric.fabric_compat",
            "minifabric.callbacks",
            "minifabric.data",
            "minifabric.seed",
            "minifabric.estimate",
            "minifabric.estimate_args",
        ),
    ),
    ("strategies", ("minifabric.strategies",)),
    ("init and checkpoint", ("minifabric.init", "minifabric.checkpoint")),
    ("precision", ("minifabric.precision", "minifabric.parameters")),
    ("runtime", ("minifabric.runtime",)),
    ("collectives", ("minifabric.collectives",)),
    ("bottom", ("minifabric._torch", "minifabric.process", "minifabric.errors")),
)

#: imports between parts that the layers allow but the house forbids
FORBIDDEN = (
    ("minifabric.checkpoint", "minifabric.strategies"),
    ("minifabric.strategies", "minifabric.checkpoint"),
    ("minifabric.checkpoint", "minifabric.runtime"),
)


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or (prefix != "minifabric" and module.startswith(prefix + "."))


def layer(module: str) -> int | None:
    """The index of ``module``'s part in :data:`LAYERS` (the longest matching name wins)."""
    best: tuple[int, int] | None = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if _within(module, name) and (best is None or len(name) > best[1]):
                best = (index, len(name))
    return best[0] if best is not None else None


def graph() -> dict[str, set[str]]:
    """Module -> the minifabric modules it imports (at run time)."""
    sources = {_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in sources}
    for me, path in sources.items():
        tree = ast.parse(path.read_text())
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for statement in block.body
            for node in ast.walk(statement)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in sources else module for alias in node.names
                ]
            for target in targets:
                while target and target not in sources:
                    target = target.rpartition(".")[0]
                if target.startswith("minifabric") and target != me:
                    edges[me].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                other = stack.pop()
                group.append(other)
                if other == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_part():
    assert not [name for name in graph() if layer(name) is None]


def test_no_import_cycles():
    assert not cycles(graph())


def test_every_import_goes_down_or_sideways():
    edges = graph()
    up = sorted(
        (a, b) for a, targets in edges.items() for b in targets if layer(b) < layer(a)  # type: ignore[operator]
    )
    banned = sorted(
        (a, b) for a, targets in edges.items() for b in targets for x, y in FORBIDDEN if _within(a, x) and _within(b, y)
    )
    assert not up and not banned, f"upward: {up}; forbidden: {banned}"


def test_the_checks_see_a_cycle_and_an_upward_import():
    edges = {"minifabric.collectives": {"minifabric.runtime.signals"}, "minifabric.runtime.signals": {"minifabric.collectives"}}
    assert cycles(edges) == [["minifabric.collectives", "minifabric.runtime.signals"]]
    assert layer("minifabric.runtime.signals") < layer("minifabric.collectives")  # type: ignore[operator]
    assert layer("minifabric") == 0 and layer("minifabric.checkpoint.service") == 3
