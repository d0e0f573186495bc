"""The history view (`h`): requests/s, tokens/s, spend per minute, error rate and requests in flight
over the whole run (every run of the directory), as charts. Read from the snapshot's timeline, so
an attached viewer shows the same, and `draftgen report RUN_DIR` prints it after the run."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from draftgen.core.live.snapshot import RunSnapshot, Timeline
from draftgen.tui import fmt
from draftgen.tui.charts import CHARTS, Chart
from draftgen.tui.panels.header import RunHeader


def draw_history(timeline: Timeline, rows: int) -> RenderableType:
    """Every chart, sharing `rows` lines: each takes a title line, its bars and a time axis."""
    charts = CHARTS
    per = max(3, rows // len(charts))
    height = max(1, per - 2)
    parts: list[RenderableType] = []
    if timeline.points:
        span = fmt.duration(len(timeline.points) * timeline.interval_s)
        runs = len(timeline.runs)
        parts.append(Text(f"{len(timeline.points)} points of {fmt.duration(timeline.interval_s)} · {span} of "
                          f"history · {runs} run{'s' if runs != 1 else ''} of this directory", style="dim",
                          no_wrap=True, overflow="ellipsis"))
        height = max(1, (rows - 1) // len(charts) - 2)
    for series, title, value, style in charts:
        parts.append(Chart(timeline, series, title, value, style, height=height))
    return Group(*parts)


class HistoryScreen(Screen[None]):
    BINDINGS = [Binding("escape,h", "back", "back")]

    def __init__(self, snapshot: RunSnapshot | None) -> None:
        super().__init__()
        self.latest = snapshot
        self._key: object = None

    def compose(self) -> ComposeResult:
        yield RunHeader("draftgen", id="header")
        yield Static(id="history-body", classes="panel")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#history-body").border_title = "history"
        if self.latest is not None:
            self.show(self.latest)

    def on_resize(self) -> None:
        if self.latest is not None:
            self._key = None
            self.show(self.latest)

    def show(self, s: RunSnapshot) -> None:
        self.latest = s
        self.query_one(RunHeader).show(s)
        body = self.query_one("#history-body", Static)
        rows, cols = body.content_region.height or (self.size.height - 4), body.content_region.width
        key = (s.timeline, rows, cols)
        if key == self._key:
            return
        self._key = key
        body.update(draw_history(s.timeline, rows))

    def action_back(self) -> None:
        self.dismiss(None)
