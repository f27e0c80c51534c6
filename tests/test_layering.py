"""Dependencies point one way (docs/architecture.md): models never import the store or a
backend implementation, the store never imports models, the engine never imports the
daemon side (serve, http, daemon) or the converter, nothing below the converter imports it,
no two top-level parts of colibrid import each other (directly or round a longer loop), and
the client package imports neither numpy nor colibrid at module level."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_level_imports(path: Path) -> set[str]:
    """Top-level modules imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def all_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


RULES = [
    (
        "colibrid/models",
        ("colibrid.store", "colibrid.backends.cpu", "colibrid.backends.native", "colibrid.engine"),
    ),
    ("colibrid/store", ("colibrid.models", "colibrid.engine", "colibrid.backends.native")),
    # the engine is the synchronous core; the daemon side (serve: host, scheduler, events)
    # drives it, never the other way round
    ("colibrid/engine", ("colibrid.serve", "colibrid.http", "colibrid.daemon")),
    # the converter writes containers with the layers below it; they never need it
    ("colibrid/engine", ("colibrid.convert",)),
    ("colibrid/models", ("colibrid.convert",)),
    ("colibrid/backends", ("colibrid.convert",)),
    ("colibrid/store", ("colibrid.convert",)),
    # the weight formats and their maths are the bottom layer: no other part of colibrid
    (
        "colibrid/formats",
        tuple(
            f"colibrid.{p.stem}"
            for p in sorted((ROOT / "colibrid").iterdir())
            if p.stem not in ("formats", "__init__", "__pycache__")
            and (p.is_dir() or p.suffix == ".py")
        ),
    ),
]


@pytest.mark.parametrize("package,forbidden", RULES)
def test_forbidden_imports(package: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        (p.relative_to(ROOT), m)
        for p in files(package)
        for m in all_imports(p)
        if m.startswith(forbidden)
    ]
    assert not bad, f"layering violations: {bad}"


def imported_colibrid_modules(path: Path) -> set[str]:
    """Every colibrid module ``path`` imports anywhere (function-level imports included);
    ``from colibrid.x import y`` counts as ``colibrid.x.y`` too, since y may be a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.relative_to(ROOT)}: relative import; use colibrid.…")
    return {m for m in found if m == "colibrid" or m.startswith("colibrid.")}


def part_of(module: str) -> str | None:
    """The top-level part of colibrid a module belongs to: a subpackage (``engine``) or a
    top-level module (``daemon``); None for the package root itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    name = parts[1]
    if (ROOT / "colibrid" / name).is_dir() or (ROOT / "colibrid" / f"{name}.py").is_file():
        return name
    return None  # a name re-exported by colibrid/__init__.py (e.g. __version__)


def part_graph() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the files behind that edge."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in files("colibrid"):
        rel = path.relative_to(ROOT / "colibrid")
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if src == "__init__":
            continue
        for module in imported_colibrid_modules(path):
            dst = part_of(module)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, set()).add(str(path.relative_to(ROOT)))
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic (depth-first)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_find_cycle_reports_a_loop() -> None:
    assert find_cycle({"a": {"b": set()}, "b": {"c": set()}}) is None
    loop = find_cycle({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}})
    assert loop == ["a", "b", "c", "a"]


def test_no_import_cycle_between_parts_of_colibrid() -> None:
    graph = part_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        edges = "\n".join(
            f"  {a} -> {b}: {', '.join(sorted(graph[a][b]))}" for a, b in itertools.pairwise(cycle)
        )
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{edges}")


def test_client_imports_no_numpy_or_colibrid_at_module_level() -> None:
    bad = [
        (p.relative_to(ROOT), m)
        for p in files("colibri_cli")
        for m in module_level_imports(p)
        if m.split(".")[0] in ("numpy", "colibrid")
    ]
    assert not bad, f"client imports heavy modules at import time: {bad}"
