"""The package's architecture, read from its imports with ``ast``: imports point down only,
module-level imports form no cycle, and the host reaches a backend only through the typed
interface in ``backends/base.py``. A future arrow upward fails here."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from flashloop_backend.backends.base import AttentionBackend

PACKAGE = Path(__file__).resolve().parents[1] / "flashloop_backend"

# Lowest first: a room may import its own modules and any room of a lower layer.
LAYERS = [
    {"_version", "config", "capabilities", "algorithms", "device_copy"},
    {"kv"},
    {"kernels"},
    {"dispatch"},
    {"registry"},
    {"backends"},
    {"host"},
    {"tools"},
    {"cli"},
]
LAYER_OF = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}
# What the host may import of the backends: the interface, never an implementation.
HOST_MAY_IMPORT = {"flashloop_backend.backends", "flashloop_backend.backends.base"}
HOST_NEVER = ("flashloop_backend.kv",)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    """The first package level of a ``flashloop_backend.*`` module (None: the face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines of ``if TYPE_CHECKING:`` blocks: annotations only, no runtime arrow."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path, typing_too: bool = False) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every runtime package import (and with
    ``typing_too`` those of ``if TYPE_CHECKING:`` blocks as well)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing_too else _type_checking_lines(tree)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if node.lineno in typing_only if hasattr(node, "lineno") else False:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module]
            # ``from flashloop_backend.x import y`` may name a submodule y
            targets += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("flashloop_backend"):
                found.append((target, node.lineno, id(node) in top))
    return found


def _existing(module: str) -> bool:
    base = PACKAGE.parent / Path(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_room_has_a_layer():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in SOURCES}
    rooms.discard("__init__")
    assert rooms <= set(LAYER_OF), f"rooms without a layer: {sorted(rooms - set(LAYER_OF))}"


@pytest.mark.parametrize("typing_too", [False, True], ids=["runtime", "annotations_too"])
def test_imports_point_down_only(typing_too):
    """Annotations too: a type a lower room names from a higher one (under
    ``TYPE_CHECKING``) would close a circle with that room's runtime imports."""
    upward = []
    for path in SOURCES:
        module = _module(path)
        room = _room(module)
        if room is None:  # the face may name anything (lazily)
            continue
        for target, line, _ in _imports(path, typing_too):
            if not _existing(target):
                continue
            other = _room(target)
            if other is None:
                upward.append(f"{module}:{line} imports the package face {target}")
            elif other != room and LAYER_OF[other] > LAYER_OF[room]:
                upward.append(f"{module}:{line} ({room}) imports {target} ({other}, above)")
    assert not upward, "\n".join(upward)


def test_the_host_reaches_backends_only_through_the_interface():
    crossings = []
    for path in sorted((PACKAGE / "host").rglob("*.py")):
        for target, line, _ in _imports(path):
            if not _existing(target):
                continue
            if target.startswith("flashloop_backend.backends") and target not in HOST_MAY_IMPORT:
                crossings.append(f"{_module(path)}:{line} imports {target}")
            if target.startswith(HOST_NEVER):
                crossings.append(f"{_module(path)}:{line} imports {target}")
    assert not crossings, "\n".join(crossings)


def _backend_expressions(tree: ast.Module):
    """Attribute accesses on an expression named ``backend`` or ``self.backend``, and
    ``getattr``/``hasattr`` calls on one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if base in ("backend", "self.backend", "engine.backend", "self.engine.backend"):
                yield node.lineno, node.attr, False
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr"):
            if node.args and "backend" in ast.unparse(node.args[0]):
                yield node.lineno, ast.unparse(node), True


def test_the_host_calls_only_what_the_interface_declares():
    declared = {name for name in dir(AttentionBackend) if not name.startswith("_")}
    declared |= set(AttentionBackend.__annotations__)
    strays = []
    for path in sorted((PACKAGE / "host").rglob("*.py")):
        for line, what, dynamic in _backend_expressions(ast.parse(path.read_text())):
            if dynamic or what not in declared:
                strays.append(
                    f"{_module(path)}:{line}: backend.{what}"
                    if not dynamic
                    else f"{_module(path)}:{line}: {what}"
                )
    assert not strays, "\n".join(strays)


def test_module_level_imports_form_no_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for path in SOURCES:
        module = _module(path)
        for target, _, top in _imports(path):
            if top and _existing(target) and target != module:
                graph[module].add(target)
    seen, stack, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in stack:
            cycles.append(" -> ".join([*stack[stack.index(node) :], node]))
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # a package imports its own submodules to re-export them: not a cycle
            if not nxt.startswith(node + ".") and not node.startswith(nxt + "."):
                visit(nxt)
        stack.pop()

    for module in sorted(graph):
        visit(module)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("room", ["algorithms"])
def test_the_algorithms_are_a_leaf(room):
    """The reference oracles import nothing else of the package."""
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for target, line, _ in _imports(path):
            assert target.startswith(f"flashloop_backend.{room}"), (
                f"{_module(path)}:{line}: {target}"
            )
