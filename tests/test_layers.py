"""The packages form layers: no two subpackages of core/ import each other (lazily or not), core never
imports a view, Textual or the simulator (Rich tables for a command's printout are allowed), and no
class grows past what one reader holds at once."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core"
MAX_CLASS_LINES = 260  # "no class over ~250 lines"


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


def test_no_class_is_longer_than_one_reader_can_hold():
    long = []
    for folder in ("core", "tui", "cli", "simulator", "headless"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "classes over the limit:\n" + "\n".join(long)
