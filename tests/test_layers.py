"""The packages form layers: no two subpackages of core/ import each other (lazily or not), no module
imports itself back through others (not even under `if TYPE_CHECKING:`), and core never imports a view,
Textual or the simulator (Rich tables for a command's printout are allowed). How long a function may grow
is ruff's (C90, pyproject.toml)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core"
FOLDERS = ("core", "tui", "cli", "simulator", "headless")  # each is draftgen.<folder> once installed


def _imports(path: Path) -> list[str]:
    """Every absolute module a file imports, at the top or inside a function."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def _package_of(path: Path, root: Path) -> str:
    """The first-level subpackage a module of `root` belongs to ('' for a module at the top)."""
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _package_graph(root: Path, prefix: str) -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in root.rglob("*.py"):
        src = _package_of(path, root)
        for name in _imports(path):
            if not name.startswith(prefix + "."):
                continue
            dst = name.split(".")[len(prefix.split("."))]
            if dst != src and (root / dst).is_dir():
                edges[(src, dst)].append(str(path.relative_to(ROOT)))
    return edges


@pytest.mark.parametrize("root, prefix", [(CORE, "draftgen.core"), (CORE / "generate", "draftgen.core.generate")],
                         ids=["core", "core.generate"])
def test_no_two_subpackages_import_each_other(root: Path, prefix: str):
    edges = _package_graph(root, prefix)
    cycles = {f"{a} <-> {b}: {sorted(set(edges[(a, b)]))} / {sorted(set(edges[(b, a)]))}"
              for (a, b) in edges if a and b and (b, a) in edges and a < b}
    assert not cycles, f"two-way imports between {prefix}'s subpackages:\n" + "\n".join(sorted(cycles))


def test_the_top_level_modules_of_core_import_no_subpackage():
    # config, errors, files, units, rundir...: the floor every subpackage stands on
    offenders = {f"{path}: {name}" for (src, dst), paths in _package_graph(CORE, "draftgen.core").items()
                 if src == "" for path in paths for name in [dst]}
    assert not offenders, "core's top-level modules import its subpackages:\n" + "\n".join(sorted(offenders))


def test_core_imports_no_view_and_no_simulator():
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in CORE.rglob("*.py") for name in _imports(path)
                 if name.split(".")[:2] in (["draftgen", "tui"], ["draftgen", "cli"], ["draftgen", "simulator"],
                                            ["draftgen", "headless"])
                 or name.split(".")[0] == "textual"]
    assert not offenders, "core must stay a plain library:\n" + "\n".join(offenders)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("draftgen", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules a file imports, at the top, inside a function or under `if TYPE_CHECKING:`
    (a type named from a module above is a circle all the same: the two modules cannot be read, changed
    or moved apart); `from package import module` is the module."""
    me = _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    # A package's own __init__ is loaded before any of its modules: importing from it closes no cycle.
    return {name for name in found if name in modules and name != me and not me.startswith(name + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return groups


def _module_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    return {name: _module_imports(path, set(paths)) for name, path in paths.items()}


def test_no_module_imports_itself_back_through_others():
    graph = _module_graph()
    cycles = [", ".join(f"{a} imports {b}" for a in group for b in sorted(graph[a]) if b in group)
              for group in _cycles(graph)]
    assert not cycles, ("import cycles between modules (lazy and TYPE_CHECKING imports included: a type a "
                        "lower module needs is a Protocol there, or moves down):\n" + "\n".join(cycles))


def test_the_cycle_finder_sees_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_one_public_class_per_name_across_the_packages() -> None:
    """One name, one idea: no two modules define a public top-level class of the same name (three
    `Verdict`s and two `Prices` once meant different things and read alike at a call site)."""
    where: dict[str, list[str]] = defaultdict(list)
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where[node.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared


def test_live_names_the_package_only() -> None:
    """`live` is core/live (what every stage publishes); no other module is named for being live."""
    named = [str(p.relative_to(ROOT)) for folder in FOLDERS for p in (ROOT / folder).rglob("*live*.py")
             if p.parent != CORE / "live"]
    assert not named, named


# Naming a server kind: the old flag and type, a kind's name compared or quoted, a kind class of
# core/server_kinds.py or an import of that module. Every other file asks the run's kind what it means
# (`config.api.server.kind.has_account`, docs/contributing.md "Add a server kind").
KIND_NAMED = re.compile(r'\b(self_hosted|ServerKind|server_kind)\b|== "openrouter"|"openai-compatible"'
                        r"|\bOpenAICompatible\b|\bOpenRouter\(\)|isinstance\([^)]*\bOpenRouter\b"
                        r"|from draftgen\.core\.server_kinds import|import draftgen\.core\.server_kinds")
KIND_FILES_MAX = 6


def test_at_most_six_files_name_a_server_kind() -> None:
    """The kinds' module, config.py (the `[api] kind` key), preflight.py (detection) and servers.py (the
    run's profile holds the kind): a new kind is one module and one registry entry, not a branch in each."""
    named = sorted(str(p.relative_to(ROOT)) for folder in ("core", "tui", "cli", "headless")
                   for p in (ROOT / folder).rglob("*.py") if KIND_NAMED.search(p.read_text()))
    assert len(named) <= KIND_FILES_MAX, f"{len(named)} files name a server kind: {', '.join(named)}"
