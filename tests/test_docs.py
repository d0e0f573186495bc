"""The documentation holds together: every relative link in README.md, BENCHMARKS.md and docs/*.md
names a file that exists (and a heading that exists, when it has an anchor), docs/README.md lists
every page, README.md stays a front page (at most 300 lines) whose test command is the one CI runs,
and the repository stands alone: no file in it points outside it at the folder of notes it was
built from."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "build",
                "dist", "node_modules"}


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a code block is an example, not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation dropped,
    spaces to dashes, a repeated heading numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} +(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(re.sub(r"`[^`\n]*`", "", prose(path.read_text())))]


def test_the_slug_rule_matches_githubs() -> None:
    assert re.sub(r"[^\w\- ]", "", "How a run ends, exit codes and the report".lower()).replace(" ", "-") == \
        "how-a-run-ends-exit-codes-and-the-report"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of this repository
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_front_page_is_short_and_the_index_lists_every_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md") if p != index}
    assert not pages - listed, f"docs/README.md does not list {sorted(p.name for p in pages - listed)}"
    assert index.resolve() in {(ROOT / t.partition('#')[0]).resolve() for t in links(ROOT / "README.md")}


def test_the_front_pages_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    command = readme[readme.index("# 2. Install and run the tests (this is exactly what CI runs: .ci/run)") + 1]
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert " && ".join(steps) == command


def test_no_file_points_outside_the_repository_at_the_notes_it_was_built_from() -> None:
    needle = "../" + "shared"  # spelled in two parts so that this file does not hold it
    hits = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder, name)
            if path.is_file() and needle.encode() in path.read_bytes():
                hits.append(str(path.relative_to(ROOT)))
    assert not hits, f"{needle} in {hits}: say the rule, or point at the docs/ page that holds it"


SOURCE_PATH = re.compile(r"\b(?:core|tui|cli|headless|simulator|tests|docs|benchmarks|scripts)/[\w./<>-]*")


def test_every_file_the_contributing_page_names_exists() -> None:
    """docs/contributing.md draws the flows and lists the files each recipe takes by their paths, in its
    prose and its diagrams: a file moved or renamed must be moved in the page too. A path with a
    placeholder (`core/<stage>/`) names a file to be made."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    named = {m.group(0).rstrip(".") for m in SOURCE_PATH.finditer(text) if "<" not in m.group(0)}
    assert len(named) >= 40  # the page names the files of both flows and of the four recipes
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"docs/contributing.md names files that do not exist: {missing}"
