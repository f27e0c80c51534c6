"""Dependencies point one way (DESIGN.md section 2): models never import the store or a
backend implementation, the store never imports models, and the client package imports
neither numpy nor colibrid at module level."""

from __future__ import annotations

import ast
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


def test_client_imports_no_numpy_or_colibrid_at_module_level() -> None:
    bad = [
        (p.relative_to(ROOT), m)
        for p in files("colibri_cli")
        for m in module_level_imports(p)
        if m.split(".")[0] in ("numpy", "colibrid")
    ]
    assert not bad, f"client imports heavy modules at import time: {bad}"
