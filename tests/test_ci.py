"""The README's second command, which CI runs (tests/test_docs.py checks they are the same), lints, then
type-checks, then tests; and the checkers it names are pinned to a minor version in the `test` extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_command(number: int) -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"# {number}\. .*\n(.+)\n", text)
    assert block, f"README.md has no command {number}"
    return block.group(1).strip()


def test_the_second_command_lints_type_checks_then_tests():
    steps = [step.strip() for step in _readme_command(2).split("&&")]
    checks = [s for s in steps if s.startswith(("ruff check", "python scripts/typecheck.py", "pytest"))]
    assert [c.split(" -")[0] for c in checks] == ["ruff check", "python scripts/typecheck.py", "pytest"]


def test_the_checkers_are_pinned_to_a_minor_version():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = {re.split(r"[<>=!~ ]", spec, maxsplit=1)[0]: spec for spec in extra}
    for tool in ("ruff", "mypy"):
        assert re.fullmatch(rf"{tool}>=(\d+)\.(\d+),<(\d+)\.(\d+)", pins.get(tool, "")), pins.get(tool)
