"""Module-level mutable state lives in ``minifabric/runtime/rank.py`` and ``minifabric/process.py`` only.

A value bound at module level is shared by every ``Accelerator`` (and every test) in the process,
and nothing resets it: state belongs on an instance. The one record of what is true of the whole
process (signals, the exception hook, the exit) is :mod:`minifabric.runtime.rank`; the
process-wide switches are :mod:`minifabric.process`. Read from the source (AST), as
``test_process_switches.py`` does, so a binding on a rare path is found as surely as a common one.

The rule: every value bound at module level (top-level statements, also inside a top-level ``if``,
``try`` or ``with``; not inside functions or classes) must be *immutable by construction*, decided
from the expression alone:

- constants, names, attributes, subscripts (a type alias such as ``Callable[[int], None]``),
  lambdas, f-strings, and operators over such values;
- a tuple whose elements are immutable by construction;
- a call of a constructor whose result cannot be changed in place (:data:`IMMUTABLE_CALLS`:
  ``frozenset``, ``tuple``, ``types.MappingProxyType``, ``re.compile``, ``logging.getLogger``,
  ``TypeVar``, ``namedtuple``, ``timedelta``, a bare ``object()`` sentinel, ...) or of a class of
  the same module declared ``@dataclass(frozen=True)``, with immutable arguments. A list, set or
  dict display (or comprehension, or ``dict.fromkeys``) handed straight to ``frozenset``, ``tuple``
  or ``MappingProxyType`` is copied or owned by it: only its elements must be immutable;
- ``contextvars.ContextVar``: it holds no value of its own; each value is set and reset by a scope
  of the current context (a token), never shared across it.

Anything else (a list, dict or set display, a comprehension, any other call: a lock, a weak
dictionary, a counter, an instance) is state. So is every ``global`` statement. Module metadata
read by the import system (``__all__`` and other dunder names) is not checked. Class attributes
are not checked here.
"""

from __future__ import annotations

import ast

from tests.unit.test_process_switches import PACKAGE, _modules

#: the modules that may hold module-level state (exactly these)
STATE_HOLDERS = {"minifabric/runtime/rank.py", "minifabric/process.py"}

#: calls whose result cannot be changed in place, by their dotted name as written
IMMUTABLE_CALLS = {
    "frozenset",
    "torch.device",  # read-only attributes
    "tuple",
    "str",
    "int",
    "float",
    "bytes",
    "object",
    "type",
    "MappingProxyType",
    "types.MappingProxyType",
    "re.compile",
    "logging.getLogger",
    "TypeVar",
    "typing.TypeVar",
    "NewType",
    "namedtuple",
    "collections.namedtuple",
    "get_args",
    "typing.get_args",
    "timedelta",
    "datetime.timedelta",
    "os.path.join",
    "os.sysconf",
    "socket.gethostname",
    "ContextVar",
    "contextvars.ContextVar",
}

#: calls that copy (or own) the one container display they are given
_COPYING_CALLS = {"frozenset", "tuple", "MappingProxyType", "types.MappingProxyType"}

#: state in modules other engineers are moving to instances; each entry is a known exception
#: today. Nothing may be added here: remove entries as they are fixed.


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return f"{owner}.{node.attr}" if owner is not None else None
    return None


def _frozen_dataclasses(tree: ast.Module) -> set[str]:
    """The classes of the module declared ``@dataclass(frozen=True)``."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for decorator in node.decorator_list:
                if (
                    isinstance(decorator, ast.Call)
                    and _dotted(decorator.func) in ("dataclass", "dataclasses.dataclass")
                    and any(
                        k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in decorator.keywords
                    )
                ):
                    found.add(node.name)
    return found


def _elements(node: ast.expr) -> list[ast.expr] | None:
    """The parts that stay reachable when ``node``, a container display, is copied; None if not one."""
    if isinstance(node, ast.List | ast.Set | ast.Tuple):
        return list(node.elts)
    if isinstance(node, ast.Dict):
        parts: list[ast.expr] = []
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:  # ``**mapping``: copied in as well
                parts += _elements(value) or [value]
            else:
                parts += [key, value]
        return parts
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        return [node.elt]
    if isinstance(node, ast.DictComp):
        return [node.key, node.value]
    if isinstance(node, ast.Call) and _dotted(node.func) == "dict.fromkeys":
        return [*node.args, *(k.value for k in node.keywords)]
    return None


def immutable(node: ast.expr, frozen_classes: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    """Whether the value of ``node`` is immutable by construction (see the module docstring)."""
    if isinstance(node, ast.Constant | ast.Name | ast.Attribute | ast.Lambda | ast.JoinedStr):
        return True
    if isinstance(node, ast.Subscript):
        return True
    if isinstance(node, ast.Tuple):
        return all(immutable(e, frozen_classes) for e in node.elts)
    if isinstance(node, ast.BinOp):
        return immutable(node.left, frozen_classes) and immutable(node.right, frozen_classes)
    if isinstance(node, ast.UnaryOp):
        return immutable(node.operand, frozen_classes)
    if isinstance(node, ast.BoolOp):
        return all(immutable(v, frozen_classes) for v in node.values)
    if isinstance(node, ast.IfExp):
        return immutable(node.body, frozen_classes) and immutable(node.orelse, frozen_classes)
    if isinstance(node, ast.Compare):
        return True  # a bool
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        if name not in IMMUTABLE_CALLS and name not in frozen_classes:
            return False
        args = [*node.args, *(k.value for k in node.keywords)]
        if name in _COPYING_CALLS and len(node.args) == 1 and not node.keywords:
            copied = _elements(node.args[0])
            if copied is not None:
                return all(immutable(e, frozen_classes) for e in copied)
        return all(immutable(a, frozen_classes) for a in args)
    return False  # list, dict and set displays, comprehensions, anything else


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run at import: the body, and the bodies of top-level ``if``/``try``/``with``."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _module_level(node.body) + _module_level(node.orelse) + _module_level(node.finalbody)
            for handler in node.handlers:
                out += _module_level(handler.body)
        elif isinstance(node, ast.With):
            out += _module_level(node.body)
    return out


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in _names(element)]
    return [ast.unparse(target)]


def violations(name: str, tree: ast.Module) -> set[tuple[str, str]]:
    """``(module, what)`` for each piece of module-level state in ``tree`` (the file ``name``)."""
    found: set[tuple[str, str]] = set()
    frozen_classes = _frozen_dataclasses(tree)
    for node in _module_level(tree.body):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n for t in targets for n in _names(t) if not (n.startswith("__") and n.endswith("__"))]
            if names and (isinstance(node, ast.AugAssign) or not immutable(node.value, frozen_classes)):
                found.update((name, n) for n in names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update((name, f"global {n}") for n in node.names)
    return found


def test_only_the_runtime_rank_and_process_py_hold_module_level_state():
    found = set().union(*(violations(name, tree) for name, tree in _modules() if name not in STATE_HOLDERS))
    new = sorted(found)
    assert not new, (
        "Module-level state belongs on an instance (what is true of the whole process: the record in"
        " minifabric/runtime/rank.py). A constant table is made immutable: a tuple, frozenset({...})"
        " or types.MappingProxyType({...}):\n" + "\n".join(f"  {path}: {what}" for path, what in new)
    )


def test_the_state_holders_exist():
    root = PACKAGE.parent
    assert all((root / name).is_file() for name in STATE_HOLDERS)


def test_the_checker_finds_each_kind_of_state_and_passes_constants():
    source = '''
import logging, re, threading, itertools
from dataclasses import dataclass
from types import MappingProxyType

@dataclass(frozen=True)
class Point:
    x: int

@dataclass
class Box:
    x: int

__all__ = ["a"]
log = logging.getLogger(__name__)
PATTERN = re.compile("x+")
NAMES = ("a", "b")
SET = frozenset({"a", "b"})
TABLE = MappingProxyType({"a": 1, **dict.fromkeys(("b", "c"), 2)})
NESTED = MappingProxyType({"a": MappingProxyType({"b": (1, 2)})})
ORIGIN = Point(0)
SENTINEL = object()
ALIAS = dict[str, int]
SUM = 1 + 2
if True:
    IN_IF = [1]
items = [1]
cache = {}
seen = set()
squares = {n: n * n for n in range(3)}
lock = threading.Lock()
counter = itertools.count()
box = Box(1)
inner = MappingProxyType({"a": {"b": 1}})
listed = tuple([[]])
both, pair = [], ()

def f():
    global counter
    local = []
'''
    found = {what for _, what in violations("minifabric/x.py", ast.parse(source))}
    assert found == {
        "IN_IF",
        "items",
        "cache",
        "seen",
        "squares",
        "lock",
        "counter",
        "box",
        "inner",
        "listed",
        "both",
        "pair",
        "global counter",
    }, found
