"""Errors: tallies by kind (429, 5xx, timeout, …), most first, and how many retries they cost."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui import fmt
from draftgen.tui.panels.panel import DrillKind, SelectablePanel


class ErrorsPanel(SelectablePanel):
    TITLE = "errors"
    WHAT = DrillKind.KIND

    def items(self, s: RunSnapshot) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self._shown(s)[0])

    def _shown(self, s: RunSnapshot) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]:
        # As many kinds as fit under the retries line; the rest summed on the last one.
        room = max(1, self.rows - 1)
        shown = s.errors if len(s.errors) <= room else s.errors[:room - 1]
        return shown, s.errors[len(shown):]

    def key(self, s: RunSnapshot) -> Any:
        return (s.errors, s.retries)

    def fit(self) -> Any:
        return self.rows

    def draw(self, s: RunSnapshot) -> RenderableType:
        table = Table.grid(expand=True, padding=(0, 0, 0, 1))
        table.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_column(justify="right", no_wrap=True)
        table.add_row(Text("retries", style="bold"), fmt.count(s.retries))
        if not s.errors:
            table.add_row(Text("no errors", style="green"), "")
            return table
        shown, rest = self._shown(s)
        for kind, n in shown:
            table.add_row(kind, Text(fmt.count(n), style="red"), style="reverse" if kind == self.selected else None)
        if rest:
            table.add_row(Text(f"+{len(rest)} more", style="dim"), fmt.count(sum(n for _, n in rest)))
        return table
