"""The house's size and state, as issue 51 set them: at most 3 modules over 500 lines and none over 650,
and no module-level container that the code changes after import (a registry, a cache, a "seen" set:
per-run state belongs to the run; a content-keyed cache is `functools.cache`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "tui", "cli", "simulator", "headless")
LONG, LONGEST, MOST_LONG = 500, 650, 3
CHANGES = frozenset({"append", "extend", "insert", "update", "add", "pop", "popitem", "clear", "setdefault",
                     "remove", "discard", "sort", "reverse", "appendleft", "extendleft", "rotate"})
# Module globals a child process sets, never the run's process (the rule is the parent's state).
CHILD_ONLY = {"core/tokens/workers.py": {"_worker"}}  # set by a tokenizer worker's pool initializer
MAKERS = frozenset({"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                    "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"})


def _modules() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_few_long_modules_and_none_too_long() -> None:
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules()}
    long = sorted((n, name) for name, n in lines.items() if n > LONG)
    assert len(long) <= MOST_LONG and all(n <= LONGEST for n, _ in long), long


def _containers(tree: ast.Module) -> set[str]:
    """Module-level names bound to a mutable container (a literal, or a call of a maker above)."""
    names: set[str] = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        call = isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in MAKERS
        if isinstance(value, (ast.Dict, ast.List, ast.Set)) or call:
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
    return names


def changed_module_state(path: Path) -> list[str]:
    """Where a module changes one of its module-level containers, or rebinds a module global, after import."""
    tree = ast.parse(path.read_text(), str(path))
    names = _containers(tree)
    child_only = CHILD_ONLY.get(path.relative_to(ROOT).as_posix(), set()) if path.is_relative_to(ROOT) else set()
    found: list[str] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found += [f"{path.name}:{node.lineno} global {n}" for n in node.names if n not in child_only]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names \
                    and node.func.attr in CHANGES:
                found.append(f"{path.name}:{node.lineno} {node.func.value.id}.{node.func.attr}()")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
                        found.append(f"{path.name}:{node.lineno} {t.value.id}[...] changed")
    return sorted(set(found), key=lambda hit: int(hit.split(":")[1].split()[0]))


def test_no_module_changes_state_of_its_own_after_import() -> None:
    found = [hit for p in _modules() for hit in changed_module_state(p)]
    assert not found, found


def test_the_state_finder_sees_a_registry_filled_at_run_time(tmp_path: Path) -> None:
    module = tmp_path / "registry.py"
    module.write_text("_SEEN: dict[str, int] = {}\n_NAMES = set()\nFLAG = False\n\n"
                      "def note(k):\n    _SEEN[k] = 1\n    _NAMES.add(k)\n\n"
                      "def turn_on():\n    global FLAG\n    FLAG = True\n\n"
                      "def read(k):\n    return _SEEN.get(k)\n")
    assert changed_module_state(module) == ["registry.py:6 _SEEN[...] changed", "registry.py:7 _NAMES.add()",
                                            "registry.py:10 global FLAG"]
