"""Process-wide switches and private torch imports live in the bottom layer only; strategies never import checkpoint.

Writes to the process's own environment (``os.environ``) are switches too, allowed in
``minifabric/process.py`` alone; building a dict for a child process from it is not a write.

Read from the source (AST), not from a running process: a switch set on a rare path (a failure, a
signal) is found as surely as one set at import.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minifabric"

#: the modules that may set process-wide switches and import torch's private modules (exactly these)
BOTTOM_LAYER = {
    "minifabric/process.py",
    "minifabric/_torch/__init__.py",
    "minifabric/_torch/compiled.py",
    "minifabric/_torch/distributed.py",
    "minifabric/_torch/init.py",
    "minifabric/_torch/philox.py",
    "minifabric/_torch/serialization.py",
    "minifabric/_torch/switches.py",
    "minifabric/_torch/versions.py",
}

#: calls that change the whole process: (object, attribute); object None = any object or a bare name
SWITCH_CALLS = {
    ("signal", "signal"),
    ("atexit", "register"),
    ("atexit", "_run_exitfuncs"),
    ("os", "_exit"),
    ("torch", "set_default_dtype"),
    ("torch", "set_num_threads"),
    (None, "set_crc32_options"),
}

#: the one module that may write the process's own environment variables
ENVIRONMENT_WRITERS = {"minifabric/process.py"}

#: methods of ``os.environ`` that change it
_ENVIRON_MUTATORS = {"setdefault", "pop", "popitem", "update", "clear", "__setitem__", "__delitem__"}

#: Work elsewhere in the tree that moves these into the bottom layer; each entry is an exception
#: that is known today. Nothing may be added here: remove entries as they are fixed.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _modules() -> list[tuple[str, ast.Module]]:
    root = PACKAGE.parent
    return [
        (str(path.relative_to(root)), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _is_private_torch(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "torch" and any(
        part.startswith("_") and not part.startswith("__") for part in parts[1:]
    )


def _absolute(name: str, module: str | None, level: int) -> str:
    """The absolute module of a ``from`` import in the file ``name``."""
    if level == 0:
        return module or ""
    package = name[: -len(".py")].split("/")[:-level]
    return ".".join([*package, *([module] if module else [])])


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` (or ``environ`` imported from ``os``) itself, not a copy of it."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _unpacked(targets: list[ast.expr]) -> list[ast.expr]:
    """The single targets of an assignment (``a, b[0] = ...`` -> ``a``, ``b[0]``)."""
    out: list[ast.expr] = []
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            out += _unpacked(list(target.elts))
        else:
            out.append(target.value if isinstance(target, ast.Starred) else target)
    return out


def _environment_writes(name: str, tree: ast.Module) -> set[tuple[str, str]]:
    """Where ``name`` changes ``os.environ`` (or could: an alias of it). A dict built from it is a copy."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in _unpacked(targets):
                if isinstance(target, ast.Subscript) and _is_environ(target.value):
                    found.add((name, "writes os.environ[...]"))
                elif _is_environ(target):
                    found.add((name, "replaces os.environ"))
            value = getattr(node, "value", None)
            if value is not None and _is_environ(value):
                found.add((name, "binds os.environ to a name (copy it instead: dict(os.environ))"))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and _is_environ(func.value) and func.attr in _ENVIRON_MUTATORS:
                found.add((name, f"calls os.environ.{func.attr}"))
            attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = (
                func.value.id
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                else "os"
            )
            if attr in ("putenv", "unsetenv") and owner == "os":
                found.add((name, f"calls os.{attr}"))
    return found


def _violations(name: str, tree: ast.Module) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute):
                    owner = target.value.id if isinstance(target.value, ast.Name) else None
                    if owner in ("sys", "threading") and target.attr == "excepthook":
                        found.add((name, f"assigns {owner}.excepthook"))
                    if target.attr == "__class__" and owner != "self":
                        found.add((name, f"swaps the class of a live object ({owner}.__class__)"))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else None
                attr = func.attr
            elif isinstance(func, ast.Name):
                owner, attr = None, func.id
            else:
                continue
            if (owner, attr) in SWITCH_CALLS or (None, attr) in SWITCH_CALLS:
                found.add((name, f"calls {attr}" if owner is None else f"calls {owner}.{attr}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_private_torch(alias.name):
                    found.add((name, f"imports private torch module {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(name, node.module, node.level)
            if _is_private_torch(module):
                found.add((name, f"imports private torch module {module}"))
            elif module.startswith("torch"):
                for alias in node.names:
                    if alias.name.startswith("_") and _is_private_torch(f"{module}.{alias.name}"):
                        found.add((name, f"imports private torch module {module}.{alias.name}"))
            if name.startswith("minifabric/strategies/") and module.startswith("minifabric.checkpoint"):
                found.add((name, f"imports {module} (strategies/ -> checkpoint/)"))
            if name.startswith("minifabric/strategies/") and module == "minifabric":
                for alias in node.names:
                    if alias.name == "checkpoint":
                        found.add((name, "imports minifabric.checkpoint (strategies/ -> checkpoint/)"))
        if isinstance(node, ast.Import) and name.startswith("minifabric/strategies/"):
            for alias in node.names:
                if alias.name.startswith("minifabric.checkpoint"):
                    found.add((name, f"imports {alias.name} (strategies/ -> checkpoint/)"))
    return found


def test_only_the_bottom_layer_sets_process_wide_switches_or_imports_private_torch():
    found = set().union(*(_violations(name, tree) for name, tree in _modules() if name not in BOTTOM_LAYER))
    new = sorted(found - KNOWN_EXCEPTIONS)
    assert not new, (
        "Process-wide switches and private torch imports belong in minifabric/process.py or"
        " minifabric/_torch/ (one named, scoped helper each); strategies/ must not import checkpoint/:\n"
        + "\n".join(f"  {path}: {what}" for path, what in new)
    )


def test_only_process_py_writes_the_environment():
    found = set().union(
        *(_environment_writes(name, tree) for name, tree in _modules() if name not in ENVIRONMENT_WRITERS)
    )
    assert not found, (
        "Writes to os.environ change the whole process: put them in a named helper of"
        " minifabric/process.py (scoped where the change is temporary). A dict for a child process"
        " (`{**os.environ, ...}`) is fine:\n" + "\n".join(f"  {path}: {what}" for path, what in sorted(found))
    )


def test_the_environment_checker_tells_writes_from_copies():
    source = """
import os
from os import environ
os.environ["A"] = "1"
os.environ["A"] += "1"
x, os.environ["B"] = 1, "2"
del os.environ["A"]
environ["C"] = "3"
os.environ.setdefault("D", "4")
os.environ.pop("D", None)
os.environ.update({"E": "5"})
os.environ.clear()
os.putenv("F", "6")
os.unsetenv("F")
os.environ = {}
alias = os.environ
# copies and reads are not writes
env = dict(os.environ)
env["G"] = "7"
child = {**os.environ, "H": "8"}
copy = os.environ.copy()
copy.pop("H", None)
value = os.environ.get("I") or os.environ["J"]
subprocess.Popen(["true"], env={**os.environ, "K": "9"})
"""
    found = {what for _, what in _environment_writes("minifabric/x.py", ast.parse(source))}
    assert found == {
        "writes os.environ[...]",
        "calls os.environ.setdefault",
        "calls os.environ.pop",
        "calls os.environ.update",
        "calls os.environ.clear",
        "calls os.putenv",
        "calls os.unsetenv",
        "replaces os.environ",
        "binds os.environ to a name (copy it instead: dict(os.environ))",
    }, found
    per_line = [_environment_writes("minifabric/x.py", ast.parse(line)) for line in source.splitlines()]
    assert sum(1 for hits in per_line if hits) == 13  # one per writing line above, none for a copy


def test_scoped_environment_restores_every_variable(monkeypatch):
    from minifabric import process

    monkeypatch.setenv("MF_TEST_SET", "before")
    monkeypatch.setenv("MF_TEST_KEPT", "user")
    monkeypatch.delenv("MF_TEST_NEW", raising=False)
    monkeypatch.delenv("MF_TEST_DEFAULT", raising=False)
    try:
        with process.scoped_environment(
            {"MF_TEST_SET": "inside", "MF_TEST_NEW": "inside"},
            defaults={"MF_TEST_KEPT": "default", "MF_TEST_DEFAULT": "default"},
        ):
            assert os.environ["MF_TEST_SET"] == "inside" and os.environ["MF_TEST_NEW"] == "inside"
            assert os.environ["MF_TEST_KEPT"] == "user"  # a default never overrides the user's value
            assert os.environ["MF_TEST_DEFAULT"] == "default"
            raise KeyError("the body fails")
    except KeyError:
        pass
    assert os.environ["MF_TEST_SET"] == "before" and os.environ["MF_TEST_KEPT"] == "user"
    assert "MF_TEST_NEW" not in os.environ and "MF_TEST_DEFAULT" not in os.environ


def test_the_bottom_layer_is_exactly_the_listed_modules():
    """A new module in ``_torch/`` is a new place for private torch: it must be listed above on purpose."""
    root = PACKAGE.parent
    torch_layer = {str(path.relative_to(root)) for path in (PACKAGE / "_torch").rglob("*.py")}
    assert torch_layer == {name for name in BOTTOM_LAYER if name.startswith("minifabric/_torch/")}
    assert not (PACKAGE / "_torch.py").exists()


def test_the_checker_finds_each_kind_of_switch():
    source = """
import sys, signal, atexit, os, torch
import torch._dynamo
from torch.utils._pytree import tree_map
from torch.utils import _pytree
from torch.serialization import set_crc32_options
from ..checkpoint import options
sys.excepthook = print
threading.excepthook = print
signal.signal(2, print)
atexit.register(print)
atexit._run_exitfuncs()
os._exit(1)
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
set_crc32_options(False)
plugin.__class__ = object
self.__class__ = object
"""
    found = {what for _, what in _violations("minifabric/strategies/x.py", ast.parse(source))}
    assert found == {
        "assigns sys.excepthook",
        "assigns threading.excepthook",
        "calls signal.signal",
        "calls atexit.register",
        "calls atexit._run_exitfuncs",
        "calls os._exit",
        "calls torch.set_default_dtype",
        "calls torch.set_num_threads",
        "calls set_crc32_options",
        "imports private torch module torch._dynamo",
        "imports private torch module torch.utils._pytree",
        "swaps the class of a live object (plugin.__class__)",
        "imports minifabric.checkpoint (strategies/ -> checkpoint/)",
    }, found
