"""Datasets: one row each with status, progress, token budget, skipped/failed counts and cost; a
turns = "all" dataset counts turns, and a line under the table counts its conversations (an agent
dataset's: steps, answers with tool calls, conversations diverged, steps sent with replayed results)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live import snapshot as snap
from draftgen.core.live.snapshot import DatasetSnapshot, RunSnapshot
from draftgen.tui import fmt
from draftgen.tui.panels.panel import DrillKind, SelectablePanel

STATUS_STYLES = {
    snap.DatasetStatus.PENDING: "dim",
    snap.DatasetStatus.RUNNING: "bold green",
    snap.DatasetStatus.PAUSED: "bold yellow",
    snap.DatasetStatus.DONE: "bold blue",
    snap.DatasetStatus.BUDGET: "bold magenta",
    snap.DatasetStatus.STOPPED: "bold red",
    snap.DatasetStatus.ERROR: "bold red",
}


def _tokens_cell(d: DatasetSnapshot) -> Text:
    used = fmt.tokens(d.tokens_used)
    if d.token_budget is None:
        return Text(used)
    style = "bold magenta" if d.tokens_used + d.tokens_in_flight >= d.token_budget else ""
    return Text(f"{used}/{fmt.tokens(d.token_budget)}", style=style)


def is_agent(d: DatasetSnapshot) -> bool:
    """An agent dataset (docs/agents.md): its answers have called tools, or its steps diverged or were
    sent with replayed results. Until its first such answer it reads as a multi-turn dataset."""
    return bool(d.tool_calls or d.diverged or d.replayed)


def conversation_note(d: DatasetSnapshot) -> Text:
    """The line under the table of a turns = "all" dataset: turns (an agent dataset's steps, with its tool
    calls, diverged and replayed counts) and conversations. A diverged conversation is one that ended
    early (its later steps are counted skipped)."""
    if not is_agent(d):
        return Text.assemble((f"{d.name}: ", "bold"), f"turns {fmt.count(d.done)}/{fmt.count(d.total)} answered; "
                             f"conversations {fmt.count(d.conversations_done)}/{fmt.count(d.conversations)} done, ",
                             (f"{fmt.count(d.conversations_ended)} ended early",
                              "magenta" if d.conversations_ended else "dim"))
    parts: list[str | tuple[str, str]] = [
        (f"{d.name}: ", "bold"), f"steps {fmt.count(d.done)}/{fmt.count(d.total)} answered, "
        f"{fmt.count(d.tool_calls)} with tool calls; conversations {fmt.count(d.conversations_done)}/"
        f"{fmt.count(d.conversations)} done, ",
        (f"{fmt.count(d.conversations_ended)} ended early", "magenta" if d.conversations_ended else "dim"), " (",
        (f"{fmt.count(d.diverged)} diverged", "yellow" if d.diverged else "dim"), ")"]
    if d.replayed:
        parts += ["; ", (f"{fmt.count(d.replayed)} replayed", "yellow")]
    return Text.assemble(*parts)


# Column headers spelled out from this content width; abbreviated below it (80-column terminals).
WIDE = 100


class DatasetsPanel(SelectablePanel):
    TITLE = "datasets"
    WHAT = DrillKind.DATASET

    def items(self, s: RunSnapshot) -> tuple[str, ...]:
        return tuple(d.name for d in s.datasets)

    def key(self, s: RunSnapshot) -> Any:
        return s.datasets

    def fit(self) -> Any:
        return self.cols >= WIDE

    def shape(self, s: RunSnapshot) -> Any:
        return tuple((bool(d.message), bool(d.conversations)) for d in s.datasets)

    def draw(self, s: RunSnapshot) -> RenderableType:
        if not s.datasets:
            return Text("no datasets yet", style="dim")
        wide = self.cols >= WIDE
        table = Table(box=None, expand=True, padding=(0, 1, 0, 0), header_style="bold", show_edge=False)
        # Widths from the totals, not the current values: columns stay put as counts and costs grow.
        count_w = max(len(fmt.count(d.total)) for d in s.datasets)
        money_w = max(8 if wide else 7, *(len(fmt.usd(x)) for d in s.datasets
                                          for x in (d.cost_usd, d.projected_cost_usd)))
        table.add_column("dataset", no_wrap=True, overflow="ellipsis", max_width=20 if wide else 12)
        table.add_column("status", no_wrap=True, min_width=7)
        table.add_column("done/total", justify="right", no_wrap=True, min_width=2 * count_w + 1)
        table.add_column("progress", ratio=1, no_wrap=True, min_width=8)
        table.add_column("tokens/budget" if wide else "tok/budget", justify="right", no_wrap=True, min_width=11)
        table.add_column("skipped" if wide else "skip", justify="right", no_wrap=True,
                         min_width=min(count_w, 6) if wide else 4)
        table.add_column("failed" if wide else "fail", justify="right", no_wrap=True,
                         min_width=min(count_w, 6) if wide else 4)
        table.add_column("cost", justify="right", no_wrap=True, min_width=money_w)
        table.add_column("proj. total" if wide else "proj.", justify="right", no_wrap=True, min_width=money_w)
        notes = []
        for d in s.datasets:
            finished = d.done + d.failed
            table.add_row(
                Text(d.name),  # the config's text, not Rich markup
                Text(d.status, style=STATUS_STYLES.get(d.status, "")),
                f"{fmt.count(d.done)}/{fmt.count(d.total)}",
                fmt.Bar(finished / d.total if d.total else 0.0, style="green" if d.status != snap.DatasetStatus.BUDGET
                        else "magenta", label=fmt.percent(finished, d.total).rjust(4), max_width=160),
                _tokens_cell(d),
                Text(fmt.count(d.skipped), style="magenta" if d.skipped else "dim"),
                Text(fmt.count(d.failed), style="bold red" if d.failed else "dim"),
                fmt.usd(d.cost_usd),
                fmt.usd(d.projected_cost_usd),
                style="reverse" if d.name == self.selected else None,
            )
            if d.conversations:  # turns = "all": done/total above are turns (an agent line's: steps)
                notes.append(conversation_note(d))
            if d.message:
                notes.append(Text.assemble((f"{d.name}: ", "bold"), d.message))
        if not notes:
            return table
        return Group(table, *notes)
