"""`draftgen retry-failed CONFIG [--dataset NAME] [--kind KIND]`: make failed prompts eligible again.

For prompts failed by mistake (a run from before draftgen classified responses by whose problem
they are, a cause outside the prompt): the chosen lines leave `<dataset>/failures.jsonl` and the
next run asks those prompts again. Nothing is lost: each line moved is first appended, whole and
fsynced, to `<dataset>/failures.history.jsonl` with `retried_at` (unix time) added; then the new
failures.jsonl (the lines kept, byte for byte) is written to a temporary file beside it, fsynced
and renamed over the old one, so a crash leaves the old file or the new one, never a mix. A crash
between the two steps leaves a line in both files: the prompt stays failed, and running the
command again moves it (its history then has it twice, which is harmless).

It refuses while a run is live in the run directory (core/files.py `exclusive`: the run lock, not
the attach socket): that run appends to the failures.jsonl this would replace (its lines would go to
the unlinked old file), and its ledger holds the failed ids in memory and would not ask them again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.files import exclusive, write_atomic
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import JsonlAppender, RunDir
from draftgen.core.safe_text import visible


@dataclass
class Retried:
    dataset: str
    moved: Counter[str] = field(default_factory=Counter)   # error_kind -> lines made eligible again
    kept: int = 0

    def line(self, history: Path) -> str:
        n = sum(self.moved.values())
        if not n:
            return f"{self.dataset}: nothing to retry ({self.kept} failed prompt(s) kept)"
        # The kinds are failures.jsonl's (a file: an older version's, or edited): shown with controls escaped.
        kinds = ", ".join(f"{visible(k)}: {v}" for k, v in self.moved.most_common())
        return (f"{self.dataset}: {n} failed prompt(s) eligible again ({kinds}); {self.kept} kept; "
                f"their lines are in {visible(str(history))}")


def history_path(rundir: RunDir, dataset: str) -> Path:
    return rundir.dataset(dataset) / "failures.history.jsonl"


def retry_dataset(rundir: RunDir, dataset: str, kinds: frozenset[str] | None) -> Retried:
    """Move the failures of `dataset` (of `kinds`, or all) to the history; see the module docstring."""
    result = Retried(dataset)
    path = rundir.failures(dataset)
    if not path.exists():
        return result
    raw = path.read_bytes()
    kept: list[bytes] = []
    moving: list[dict[str, object]] = []
    now = round(time.time(), 3)
    for line in raw.splitlines(keepends=True):
        obj = None
        if line.endswith(b"\n"):
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                obj = None
        if not isinstance(obj, dict) or (kinds is not None and str(obj.get("error_kind")) not in kinds):
            kept.append(line)  # not chosen, or not a whole record: left exactly as it was
            continue
        moving.append({**obj, "retried_at": now})
        result.moved[str(obj.get("error_kind"))] += 1
    result.kept = sum(1 for line in kept if line.strip())
    if not moving:
        return result
    history = JsonlAppender(history_path(rundir, dataset), fsync=True)
    try:
        for obj in moving:
            history.append(obj)
    finally:
        history.close()
    write_atomic(path, b"".join(kept), fsync=True)
    return result


def retry_failed(config: Config, *, dataset: str | None = None, kinds: frozenset[str] | None = None) -> list[Retried]:
    rundir = RunDir(config.run_dir)
    names = [d.name for d in config.datasets]
    if dataset is not None and dataset not in names:
        raise DraftgenError(f"--dataset {dataset!r}: no such dataset in {config.path} (datasets: {', '.join(names)})")
    with exclusive(rundir.root, "draftgen retry-failed"):
        return [retry_dataset(rundir, name, kinds) for name in names if dataset in (None, name)]


def retry_failed_command(config: Config, dataset: str | None, kind: str | None) -> int:
    kinds = frozenset(k.strip() for k in kind.split(",") if k.strip()) if kind else None
    results = retry_failed(config, dataset=dataset, kinds=kinds)
    rundir = RunDir(config.run_dir)
    for r in results:
        print(r.line(history_path(rundir, r.dataset)))
    if kinds is not None and not any(r.moved for r in results):
        from draftgen.core.records import ERROR_KINDS, KEPT_ANSWER_KINDS
        print(f"no failure of kind {', '.join(sorted(kinds))}; failure kinds: "
              f"{', '.join(k for k in ERROR_KINDS if k not in KEPT_ANSWER_KINDS)}")
        if kept := sorted(kinds & KEPT_ANSWER_KINDS):
            # Cut, empty or id-less answers are answers: in responses.jsonl, paid for, never re-asked here.
            print(f"{', '.join(kept)}: answers kept in responses.jsonl (marked), not failures; retry-failed "
                  "does not ask them again")
    total = sum(sum(r.moved.values()) for r in results)
    print(f"{total} prompt(s) eligible again: run `draftgen run {sh_path(config.path)}` to answer them")
    return 0
