"""Dependencies point one way (docs/architecture.md), checked on the source, not at run time.

The rules: models never import the store or a backend implementation (only the shared
types of `backends.base` and the MoE plan a fused `Ops.moe` must match), the store never
imports models or the engine, the engine never imports the daemon side (serve, http,
daemon, control, cli) or the converter, nothing below the converter imports it, the weight
formats import nothing of colibrid, the wire protocol imports neither colibrid nor the
client, and the client package imports neither numpy nor colibrid at module level.

How they are held:

- Each part (a subpackage of colibrid, a top-level module of it, the client package, the
  protocol package) has an ALLOW-list: the modules or packages it may import. A deny-list
  only stops what someone thought to list (the old one let models import the cuda
  backend); an allow-list stops everything new until someone decides it belongs. The lists
  were taken from what the code imported when they were written.
- RULES states the rules above; the allow-lists are checked against it, so widening
  one past a rule fails with the rule's reason, and the code is checked against it
  transitively (a model importing a shared module that imports an implementation is still
  a model importing an implementation).
- No two parts import each other, directly or round a longer loop, and neither do two
  modules. Every import counts, wherever it is written: at module level, under
  ``if TYPE_CHECKING:`` and inside a function (lazy). A lazy import is fine for what it is
  for, deferring a heavy or optional dependency; moving one into a function to dodge an
  import-time error still leaves two modules that cannot be read, tested or moved apart,
  so an import that closes a loop is a design cycle wherever it sits. Cycles among
  module-level imports alone are checked on their own too, with no exception, since those
  are the ones that break at import time.

What the check cannot see: imports built at run time from non-literal strings
(``importlib.import_module(f"colibrid.models.{model_type}")``, the client's command table
naming the module each subcommand runs). ``importlib.import_module("a.literal")`` is
counted like an import statement.
"""

from __future__ import annotations

import ast
import collections
import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent

# import name -> folder; protocol/ ships as colibri_protocol (pyproject.toml)
PACKAGES = {
    "colibrid": ROOT / "colibrid",
    "colibri_cli": ROOT / "colibri_cli",
    "colibri_protocol": ROOT / "protocol",
}

# Module cycles the code still has, each as the set of modules in the loop, and why it is
# tolerated for now. test_no_import_cycle_between_modules fails on any other cycle and on
# an entry here that is gone: once a loop is broken, delete its line.
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # none: a new cycle is a failure

# --- the import graph, from the source -------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One import in one file: the module it names (the submodule, for ``from package import
    submodule``) and where it runs: "module" (at import time), "typing" (under
    ``if TYPE_CHECKING:``) or "lazy" (inside a function)."""

    source: str
    target: str
    kind: str
    path: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.kind})"


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_import_module(node: ast.AST) -> str | None:
    """The module of ``importlib.import_module("a.b")`` (a literal name only)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


@functools.cache
def imports_of(module: str) -> tuple[Import, ...]:
    """Every import in the module's file, each with where it runs."""
    path = modules()[module]
    known = modules()
    found: list[Import] = []

    def add(target: str, kind: str, node: ast.AST) -> None:
        found.append(Import(module, target, kind, path, getattr(node, "lineno", 0)))

    def walk(nodes: Iterable[ast.AST], kind: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(ast.iter_child_nodes(node), "lazy")
                continue
            if isinstance(node, ast.If) and _is_type_checking(node.test) and kind == "module":
                walk(node.body, "typing")
                walk(node.orelse, kind)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, kind, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    raise AssertionError(f"{path.relative_to(ROOT)}: relative import")
                assert node.module is not None
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    add(sub if sub in known else node.module, kind, node)
            elif (name := _literal_import_module(node)) is not None:
                add(name, kind, node)
            walk(ast.iter_child_nodes(node), kind)

    walk(ast.parse(path.read_text(encoding="utf-8")).body, "module")
    return tuple(found)


def all_imports() -> list[Import]:
    return [imp for module in modules() for imp in imports_of(module)]


def within(module: str, entry: str) -> bool:
    """Whether ``module`` is ``entry`` or under it; the package root "colibrid" names only
    itself, not all of colibrid."""
    return module == entry or (entry != "colibrid" and module.startswith(entry + "."))


def part_of(module: str) -> str | None:
    """The allow-list a module answers to: the most specific part containing it."""
    parts = [p for p in ALLOWED if within(module, p)]
    return max(parts, key=len) if parts else None


def is_ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


# --- the rules -------------------------------------------------------------------------

# The backends' modules a model may import: shared types and the MoE plan, no arithmetic
# of any one backend. Everything else under colibrid/backends is an implementation.
SHARED_BACKEND_MODULES = ("colibrid.backends.base", "colibrid.backends.moe_plan")

# part -> what it may import besides itself. A part is a subpackage of colibrid or a
# top-level module of it (named by module), or one of the other two packages; an entry is
# a module or a package (allowing everything under it), "colibrid" alone is the package
# root (__version__).
ALLOWED: dict[str, frozenset[str]] = {
    # the bottom: the weight formats and their maths, the errors, the expert policies
    "colibrid.formats": frozenset(),
    "colibrid.errors": frozenset(),
    "colibrid.policy": frozenset(),
    "colibrid.logfile": frozenset(),
    "colibrid.panic_report": frozenset(),
    "colibrid.pipes": frozenset(),  # how both entry points end when their reader leaves
    "colibrid.file_hash": frozenset(),  # a file's SHA-256 and CRC-32 (downloads, inputs)
    "colibri_protocol": frozenset(),  # the wire format, shared by daemon and client
    "colibrid": frozenset(),
    "colibrid.paths": frozenset({"colibrid.errors", "colibri_protocol"}),
    "colibrid.installed": frozenset(
        {"colibrid.errors", "colibrid.paths", "colibrid.remote.spec", "colibrid.remote.keyfile"}
    ),
    # remote models: their file under models/, their keys, their endpoint's wire format
    "colibrid.remote": frozenset({"colibrid.errors", "colibrid.paths", "colibrid.config"}),
    # the arithmetic; it implements models.base.Ops without importing it
    "colibrid.backends": frozenset({"colibrid.errors", "colibrid.formats", "colibrid.policy"}),
    "colibrid.models": frozenset({"colibrid.errors", "colibrid.formats", *SHARED_BACKEND_MODULES}),
    "colibrid.store": frozenset(
        {
            "colibrid.errors",
            "colibrid.formats",
            "colibrid.paths",
            "colibrid.policy",
            "colibrid.backends.base",
        }
    ),
    # the synchronous core: picks the backend, loads the model, drives the store
    "colibrid.engine": frozenset(
        {
            "colibrid.errors",
            "colibrid.formats",
            "colibrid.paths",
            "colibrid.backends",
            "colibrid.models",
            "colibrid.store",
        }
    ),
    "colibrid.config": frozenset(
        {"colibrid.errors", "colibrid.paths", "colibrid.engine", "colibrid.store"}
    ),
    "colibrid.config_reference": frozenset({"colibrid.config", "colibrid.paths"}),
    "colibrid.convert": frozenset(
        {
            "colibrid.errors",
            "colibrid.formats",
            "colibrid.paths",
            "colibrid.config",
            "colibrid.engine",
            "colibrid.models",
            "colibrid.store",
            # `requant --max-kl` scores its candidates with `colibri eval`
            "colibrid.quality",
            "colibrid.remote",  # `colibri pull URL` registers a remote model
            "colibrid.file_hash",  # the demo's wheel checked, requant's inputs named
        }
    ),
    # quality measured: `colibri eval` runs two models teacher-forced (engine), reads expert
    # sizes from headers and probes the disk (store), and the built-in profile prompts
    "colibrid.quality": frozenset(
        {
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.engine",
            "colibrid.store",
            "colibri_cli.commands.profile",
        }
    ),
    # the daemon side: scheduler and SERVE socket, HTTP, the process, its control
    "colibrid.serve": frozenset(
        {
            "colibrid",
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.config",
            "colibrid.backends",
            "colibrid.engine",
            "colibrid.store",
            "colibri_protocol",
            "colibrid.installed",  # which names are remote models
            "colibrid.remote",  # their requests stream from their endpoint
        }
    ),
    "colibrid.http": frozenset(
        {
            "colibrid.errors",
            "colibrid.installed",
            "colibrid.engine",
            "colibrid.serve",
            "colibri_protocol",
        }
    ),
    "colibrid.daemon": frozenset(
        {
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.config",
            "colibrid.serve",
            "colibrid.http",
            "colibrid.remote",  # a remote model cannot be the default
        }
    ),
    "colibrid.control": frozenset(
        {
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.logfile",
            "colibrid.config",
            "colibrid.backends",
            "colibrid.engine",
            "colibrid.serve",
            "colibrid.daemon",
            "colibri_protocol",
        }
    ),
    "colibrid.cli": frozenset(
        {
            "colibrid",
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.panic_report",
            "colibrid.pipes",
            "colibrid.config",
            "colibrid.backends",
            "colibrid.store",
            "colibrid.engine",
            "colibrid.control",
        }
    ),
    "colibrid.__main__": frozenset({"colibrid.cli"}),
    # measurements: above everything they measure, below nothing
    "colibrid.bench": frozenset(
        {
            "colibrid.errors",
            "colibrid.formats",
            "colibrid.paths",
            "colibrid.policy",
            "colibrid.config",
            "colibrid.backends",
            "colibrid.store",
            "colibrid.engine",
            "colibrid.convert",
            "colibrid.cli",
            # the prompt files `colibri profile` reads; bench replays the same ones
            "colibri_cli.commands.profile",
        }
    ),
    # beyond one machine: llama.cpp's RPC build (pinned as bench peer's), and `colibri
    # plan`, which measures as the daemon does (inspect's sizes, the store's disk probe,
    # the native memory probe) and prints other engines' command lines
    "colibrid.cluster": frozenset(
        {
            "colibrid.errors",
            "colibrid.paths",
            "colibrid.config",
            "colibrid.backends",
            "colibrid.store",
            "colibrid.engine",
            "colibrid.convert",
            "colibrid.bench",
            "colibrid.remote",  # a remote model is refused by name (its remote.json)
            "colibrid.file_hash",  # llama.cpp's sdist checked against its pin
        }
    ),
    # the light client: the protocol, and the daemon side only lazily, for the commands
    # that run it in-process (test_client_imports_no_numpy_or_colibrid_at_module_level),
    # and the stdlib-only exit rule both entry points share (colibrid.pipes)
    "colibri_cli": frozenset(
        {
            "colibri_protocol",
            "colibrid.cli",
            "colibrid.errors",
            "colibrid.installed",
            "colibrid.paths",
            "colibrid.pipes",
        }
    ),
}


def everything_but(part: str) -> tuple[str, ...]:
    """Every other part: what the bottom layers must not import."""
    return tuple(p for p in ALLOWED if p != part)


def backend_implementations() -> tuple[str, ...]:
    """Every module under colibrid/backends but the shared ones: a new backend is an
    implementation without anyone listing it."""
    return tuple(
        m
        for m in modules()
        if m.startswith("colibrid.backends.") and m not in SHARED_BACKEND_MODULES
    )


class Rule(NamedTuple):
    """A line no allow-list may cross: ``part`` never imports anything under ``forbidden``,
    directly or through another module."""

    name: str
    part: str
    forbidden: tuple[str, ...]
    why: str


RULES = [
    Rule(
        "models-use-protocols",
        "colibrid.models",
        ("colibrid.store", "colibrid.engine", *backend_implementations()),
        "models see experts through the ExpertSource protocol and arithmetic through Ops",
    ),
    Rule(
        "store-holds-bytes",
        "colibrid.store",
        ("colibrid.models", "colibrid.engine", *backend_implementations()),
        "the store holds bytes; what they compute is the models' and backends' business",
    ),
    Rule(
        "engine-below-daemon",
        "colibrid.engine",
        (
            "colibrid.serve",
            "colibrid.http",
            "colibrid.daemon",
            "colibrid.control",
            "colibrid.cli",
        ),
        "the engine is the synchronous core; the daemon side drives it, never the reverse",
    ),
    *(
        Rule(
            f"{part.rsplit('.', 1)[-1]}-below-convert",
            part,
            ("colibrid.convert",),
            "the converter writes containers with the layers below it; they never need it",
        )
        for part in ("colibrid.engine", "colibrid.models", "colibrid.backends", "colibrid.store")
    ),
    Rule(
        "formats-at-the-bottom",
        "colibrid.formats",
        everything_but("colibrid.formats"),
        "the weight formats and their maths are the bottom layer",
    ),
    Rule(
        "protocol-belongs-to-neither",
        "colibri_protocol",
        everything_but("colibri_protocol"),
        "the wire format is shared by both ends and belongs to neither",
    ),
]


# --- allow-lists ------------------------------------------------------------------------


def test_every_module_answers_to_an_allow_list() -> None:
    orphans = sorted(m for m in modules() if part_of(m) is None)
    assert not orphans, f"no allow-list covers {orphans}: add its part to ALLOWED"


def test_allow_lists_name_real_modules() -> None:
    """A misspelt entry would allow nothing and hide the mistake."""
    stale = sorted(
        (part, entry)
        for part, entries in ALLOWED.items()
        for entry in {part} | entries
        if not any(within(m, entry) for m in modules())
    )
    assert not stale, f"allow-lists name modules that do not exist: {stale}"


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_stay_within_the_allow_list(part: str) -> None:
    allowed = ALLOWED[part]
    bad = sorted(
        f"{imp.where}: {imp.target}"
        for imp in all_imports()
        if part_of(imp.source) == part
        and is_ours(imp.target)
        and part_of(imp.target) != part
        and not any(within(imp.target, entry) for entry in allowed)
    )
    assert not bad, f"{part} may import only {sorted(allowed)}; also imports:\n" + "\n".join(bad)


def overlaps(a: str, b: str) -> bool:
    """Whether a module could be both under ``a`` and under ``b``."""
    return within(a, b) or within(b, a)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_allow_lists_keep_the_architecture(rule: Rule) -> None:
    bad = sorted({e for e in ALLOWED[rule.part] for f in rule.forbidden if overlaps(e, f)})
    assert not bad, f"ALLOWED[{rule.part!r}] lets it import {bad}, against: {rule.why}"


def closure(start: Iterable[str], kinds: Iterable[str]) -> dict[str, Import | None]:
    """Every module reachable from ``start`` over imports of ``kinds``, each with the import
    that first reached it (None for the start)."""
    kinds = frozenset(kinds)
    seen: dict[str, Import | None] = dict.fromkeys(start)
    todo = collections.deque(seen)  # breadth-first: each module by a shortest chain
    while todo:
        for imp in imports_of(todo.popleft()):
            if imp.kind in kinds and imp.target in modules() and imp.target not in seen:
                seen[imp.target] = imp
                todo.append(imp.target)
    return seen


def chain(reached: dict[str, Import | None], module: str) -> str:
    """How ``module`` was reached, one import a line."""
    lines: list[str] = []
    while (imp := reached[module]) is not None:
        lines.append(f"  {imp.source} -> {module}: {imp.where}")
        module = imp.source
    return "\n".join(reversed(lines))


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_forbidden_modules_are_not_reached_through_others(rule: Rule) -> None:
    reached = closure(
        (m for m in modules() if part_of(m) == rule.part), ("module", "typing", "lazy")
    )
    bad = [m for m in reached if any(overlaps(m, f) for f in rule.forbidden)]  # nearest first
    assert not bad, f"{rule.part} reaches {bad[0]} ({rule.why}):\n{chain(reached, bad[0])}"


def test_client_imports_no_numpy_or_colibrid_at_module_level() -> None:
    """`colibri` starts in milliseconds: importing the client (and, through it, the
    protocol) must not load numpy or the daemon side."""
    reached = closure((m for m in modules() if within(m, "colibri_cli")), ("module",))
    bad = sorted(
        f"{imp.where}: {imp.target}\n{chain(reached, imp.source)}"
        for module in reached
        for imp in imports_of(module)
        if imp.kind == "module" and imp.target.split(".")[0] in ("numpy", "colibrid")
    )
    assert not bad, "client imports heavy modules at import time:\n" + "\n".join(bad)


# --- cycles -----------------------------------------------------------------------------

Graph = dict[str, dict[str, set[str]]]  # node -> next node -> the imports behind the edge


def graph_of(imports: Iterable[Import], node: Callable[[str], str | None] = lambda m: m) -> Graph:
    """The graph of ``imports`` between our modules, or between what ``node`` maps them to
    (None: left out)."""
    graph: Graph = {}
    for imp in imports:
        if not is_ours(imp.target) or imp.target not in modules():
            continue
        a, b = node(imp.source), node(imp.target)
        if a is not None and b is not None and a != b:
            graph.setdefault(a, {}).setdefault(b, set()).add(imp.where)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
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


def cycles(graph: Graph) -> dict[frozenset[str], list[str]]:
    """Every strongly connected set of nodes (those that import each other round some loop),
    each with one loop through it: two cycles that share a module are one knot to untie."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: dict[frozenset[str], list[str]] = {}

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(members) > 1:
                inside = {a: {b: w for b, w in graph[a].items() if b in members} for a in members}
                loop = find_cycle(inside)
                assert loop is not None
                found[frozenset(members)] = loop

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def describe(graph: Graph, loop: list[str]) -> str:
    """A loop with the imports behind each of its edges."""
    edges = "\n".join(
        f"  {a} -> {b}: {', '.join(sorted(graph[a][b]))}" for a, b in itertools.pairwise(loop)
    )
    return f"import cycle {' -> '.join(loop)}:\n{edges}"


def test_cycle_search_reports_a_loop() -> None:
    assert find_cycle({"a": {"b": set()}, "b": {"c": set()}}) is None
    loop = find_cycle({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}})
    assert loop == ["a", "b", "c", "a"]
    knots = cycles({"a": {"b": set()}, "b": {"a": set(), "c": set()}, "c": {"d": set()}})
    assert knots == {frozenset({"a", "b"}): ["a", "b", "a"]}


def test_allow_lists_form_no_cycle() -> None:
    """Allowing an import that closes a loop between parts fails here, before any code does."""
    graph: Graph = {
        part: {p: set() for e in entries if (p := part_of(e)) is not None and p != part}
        for part, entries in ALLOWED.items()
    }
    loop = find_cycle(graph)
    assert loop is None, f"the allow-lists loop: {' -> '.join(loop)}"


def test_no_import_cycle_between_parts() -> None:
    graph = graph_of(all_imports(), part_of)
    loop = find_cycle(graph)
    assert loop is None, describe(graph, loop)


def test_no_cycle_among_module_level_imports() -> None:
    """No exceptions here: these are the loops that break at import time."""
    graph = graph_of(imp for imp in all_imports() if imp.kind == "module")
    found = cycles(graph)
    assert not found, "\n".join(describe(graph, loop) for loop in found.values())


def test_no_import_cycle_between_modules() -> None:
    """Lazy and type-only imports included (the module docstring says why); only the
    cycles in KNOWN_CYCLES are let through, and each must still be there."""
    graph = graph_of(all_imports())
    found = cycles(graph)
    for knot, loop in found.items():
        if knot in KNOWN_CYCLES:  # shown with -rP: tolerated, not forgotten
            print(f"known ({KNOWN_CYCLES[knot]}): {describe(graph, loop)}")
    new = [describe(graph, loop) for knot, loop in found.items() if knot not in KNOWN_CYCLES]
    gone = [sorted(knot) for knot in KNOWN_CYCLES if knot not in found]
    assert not new, "\n".join(new)
    assert not gone, f"no longer cycles, delete them from KNOWN_CYCLES: {gone}"
