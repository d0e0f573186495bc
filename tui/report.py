"""`draftgen report RUN_DIR`: how a run went, from its files alone (it may be running, finished, or
copied elsewhere): answered, failed and rejected per dataset (an agent dataset's steps, tool calls and
divergences below the table), the spend on disk, and the history
charts from history.jsonl (core/live/timeline.py). Costs are the spend ledger's (spend.jsonl), the
figures the run's views show; a directory without one falls back to its answers' usage.cost.
Then which merge merged/ is and which merge the hidden states belong to, with how many samples they
cover (core/tokens/identity.py: merged/fingerprint.json, hidden_states/merge.json)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.timeline import timeline_from_file
from draftgen.core.records import StoredResponse, same_model, stored_responses
from draftgen.core.rundir import RunDir, iter_jsonl
from draftgen.core.safe_text import visible
from draftgen.core.tokens import identity
from draftgen.core.units import usd_shown
from draftgen.tui import fmt
from draftgen.tui.charts import CHARTS, Chart


def _run_config(rd: RunDir) -> dict[str, Any]:
    """The config the last run recorded in run.json ({} if none, or unreadable)."""
    try:
        config = orjson.loads(rd.run_json.read_bytes()).get("config", {})
        return config if isinstance(config, dict) else {}
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return {}


def _datasets(rd: RunDir, config: dict[str, Any]) -> list[str]:
    """Dataset names from run.json in config order, else the folders holding a responses.jsonl."""
    datasets = config.get("datasets")
    names = [str(d["name"]) for d in datasets if isinstance(d, dict) and "name" in d] \
        if isinstance(datasets, list) else []
    return names or sorted(p.parent.name for p in rd.root.glob("*/responses.jsonl"))


def _count(path: Path) -> int:
    return sum(1 for _ in iter_jsonl(path)) if path.exists() else 0


def report(run_dir: Path, out: TextIO | None = None, width: int | None = None) -> None:
    """Print the report of `run_dir` to `out` (sys.stdout as it is at the call: not bound at import)."""
    rd = RunDir(run_dir)
    console = Console(file=out or sys.stdout, width=width or min(120, Console().width), highlight=False)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col, justify in (("dataset", "left"), ("answered", "right"), ("failed", "right"), ("rejected", "right"),
                         ("truncated", "right"), ("tokens", "right"), ("cost", "right")):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    # Read only: a run may be writing it.
    ledger = SpendLedger.read(rd.spend) if rd.spend.exists() else None
    totals = [0, 0, 0, 0, 0, 0.0]
    config = _run_config(rd)
    api = config.get("api")
    asked = api.get("model") if isinstance(api, dict) else None  # the model asked (run.json), to judge answers by
    other_model: dict[str, int] = {}  # answers from another model, by dataset: kept, never a sample
    agents: list[tuple[str, AgentFigures]] = []
    for name in _datasets(rd, config):
        answered = truncated = tokens = 0
        cost = 0.0
        agent = AgentFigures()
        for _, rec in stored_responses(rd.responses(name)):
            answered += 1
            agent.add(rec)
            raw_usage = rec.get("usage")
            usage = raw_usage if isinstance(raw_usage, dict) else {}
            n = usage.get("completion_tokens")
            tokens += n if isinstance(n, int) and not isinstance(n, bool) else 0
            c = usage.get("cost")
            cost += c if isinstance(c, (int, float)) and not isinstance(c, bool) else 0.0
            truncated += bool(rec.get("truncated") or rec.get("empty_content"))
            if isinstance(asked, str) and not same_model(asked, rec.get("model")):
                other_model[name] = other_model.get(name, 0) + 1
        if agent.steps:
            agents.append((name, agent))
        if ledger is not None:  # the dataset's figure in the run's views (projection.py: by_dataset, else usage)
            cost = ledger.by_dataset.get(name, cost)
        row = [answered, _count(rd.failures(name)), _count(rd.rejected(name)), truncated, tokens, cost]
        # The total row is the sum of the rows as shown.
        totals = [a + b for a, b in zip(totals, row[:5] + [usd_shown(cost)])]
        # Names and the lines below are read from files (a name may be a folder's): shown as text, not Rich
        # markup (`[link=...]` would be a link), with their controls escaped.
        table.add_row(Text(visible(name)), fmt.count(row[0]), fmt.count(row[1]), fmt.count(row[2]), fmt.count(row[3]),
                      fmt.tokens(row[4]), fmt.usd(row[5]))
    table.add_row(Text("total", style="bold"), *(fmt.count(x) for x in totals[:4]), fmt.tokens(totals[4]),
                  fmt.usd(totals[5]))
    console.print(Text(f"draftgen report: {visible(str(rd.root.resolve()))}", style="bold"))
    console.print(table)
    if ledger is not None:
        other = usd_shown(ledger.spent_usd) - totals[5]
        console.print(Text(f"spent {fmt.usd(ledger.spent_usd)} in all (spend.jsonl)"
                           + (f": answers {fmt.usd(totals[5])}, smoke tests and unanswered attempts {fmt.usd(other)}"
                              if abs(other) >= 0.005 else "")
                           + (f"; {fmt.usd(ledger.pending_usd)} of it pending a price, at its worst case"
                              if ledger.pending_usd else "")))
    if other_model:  # as the run's summary says them (core/live/summary.py)
        by = ", ".join(f"{visible(n)} {fmt.count(c)}" for n, c in other_model.items())
        n = fmt.count(sum(other_model.values()))
        console.print(Text(f"{n} answers from another model than {visible(str(asked))} "
                           f"({by}): kept, but never a sample (merge leaves them out); check [api] model, "
                           f"[request] provider and the server", style="yellow"))
    for name, agent in agents:  # as the run's summary says them (core/live/summary.py agent_counts)
        console.print(Text(f"{visible(name)}: {agent.line()}"))
    for line, style in merge_lines(rd):
        console.print(Text(visible(line), style=style))
    timeline = timeline_from_file(rd.history)
    if not timeline.points:
        console.print(Text(f"\nno history: {visible(str(rd.history))} is missing or empty (written by runs since "
                           f"this version)", style="dim"))
        return
    console.print(Text(f"\nhistory: {len(timeline.runs)} run(s), "
                       f"{fmt.duration(len(timeline.points) * timeline.interval_s)}"
                       f" in points of {fmt.duration(timeline.interval_s)}", style="bold"))
    for series, title, value, style in CHARTS:
        console.print(Chart(timeline, series, title, value, style, height=4))


class AgentFigures:
    """An agent dataset's figures from its records (docs/agents.md): steps answered (the records of agent
    lines, which carry `tools`), those that called tools, the conversations that diverged by step, the
    steps sent with a replayed result."""

    def __init__(self) -> None:
        self.steps = self.tool_calls = self.replayed = 0
        self.diverged: dict[int, int] = {}

    def add(self, rec: StoredResponse) -> None:
        if "tools" not in rec:
            return
        self.steps += 1
        self.tool_calls += bool(rec.get("tool_calls"))
        self.replayed += rec.get("tool_results") == "replayed"
        turn = rec.get("turn")
        if rec.get("diverged") is True and isinstance(turn, int):
            self.diverged[turn] = self.diverged.get(turn, 0) + 1

    def line(self) -> str:
        at = ", ".join(f"step {k}: {fmt.count(n)}" for k, n in sorted(self.diverged.items()))
        return (f"{fmt.count(self.steps)} agent steps answered, {fmt.count(self.tool_calls)} called tools, "
                f"{fmt.count(sum(self.diverged.values()))} conversations diverged" + (f" (at {at})" if at else "")
                + f", {fmt.count(self.replayed)} steps sent with a replayed tool result")


def merge_lines(rd: RunDir) -> list[tuple[str, str]]:
    """(line, style): which merge merged/ is, and which the hidden states belong to and how many samples
    they cover. From the recorded fingerprints alone (`draftgen extract` checks the samples themselves)."""
    merged = identity.read_fingerprint(rd.merged / identity.FINGERPRINT_FILE)
    lines: list[tuple[str, str]] = []
    if merged is not None:
        lines.append((f"merged/: {merged.describe()}", ""))
    elif (rd.merged / "tokens").is_dir():
        lines.append(("merged/: merged by an older draftgen (no fingerprint.json; merge again to record one)", "dim"))
    files = identity.stored_samples(rd.hidden_states) if rd.hidden_states.is_dir() else 0
    if not files:
        return lines
    stored = identity.read_fingerprint(rd.hidden_states / identity.HIDDEN_MERGE_FILE)
    if stored is None:
        return [*lines, (f"hidden states: {files:,} files, from an unrecorded merge (`draftgen extract` checks each "
                         f"file against merged/ and records it)", "yellow")]
    cover = f"{files:,} of {stored.samples:,} samples"
    if merged is not None and not stored.same_merge(merged):
        why = "; ".join(identity.differences(stored, merged))
        return [*lines, (f"hidden states: {cover} of {stored.describe()}, ANOTHER merge than merged/ ({why}); "
                         f"`draftgen extract --start-over` or `--set-aside` extracts this one", "bold red")]
    return [*lines, (f"hidden states: {cover} of {stored.describe()}"
                     + (", the merge in merged/" if merged is not None else ""), "")]


def report_command(run_dir: Path) -> int:
    report(run_dir)
    return 0
