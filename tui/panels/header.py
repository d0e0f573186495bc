"""Header: run name, model, state, elapsed time; and the alert bar under it (e.g. 402, out of credits)."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live import snapshot as snap
from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui import fmt
from draftgen.tui.panels.panel import Panel

STATE_STYLES = {
    snap.RunState.RUNNING: "bold black on green",
    snap.RunState.PAUSED: "bold black on yellow",
    snap.RunState.DRAINING: "bold black on yellow",
    snap.RunState.DONE: "bold white on blue",
    snap.RunState.STOPPED: "bold white on red",
    snap.RunState.DRAINED: "bold black on yellow",
    snap.RunState.WAITING: "bold black on magenta",
    snap.RunState.LIMITED: "bold black on yellow",
    snap.RunState.IDLE: "bold reverse",
    "SMOKE TEST": "bold black on cyan",
    "TOKENS": "bold black on cyan",
    "MERGING": "bold black on cyan",
    "EXTRACTING": "bold black on cyan",
    "FAILED": "bold white on red",
}


class RunHeader(Panel):
    FRAMED = False

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.app_title = title
        self.update(Text(f" {title} · waiting for the first snapshot…", style="bold"))

    def key(self, s: RunSnapshot) -> Any:
        eta = fmt.duration(s.throughput.eta_s) if s.throughput.eta_s is not None else ""
        return (s.run_name, s.model, s.label, int(s.elapsed_s), s.attached, eta, len(s.timeline.runs))

    def fit(self) -> Any:
        return self.cols < 100

    def draw(self, s: RunSnapshot) -> RenderableType:
        # State first: on a narrow terminal the model name is what gets cut, never the state.
        label = s.label  # the run's owner decides it (core/run/life.py `standing`)
        left = Text.assemble((f" {label} ", STATE_STYLES.get(label, "bold reverse")), " ")
        narrow = self.cols < 100  # 80x24: the run name must stay, so the clock gets short
        if s.attached:
            left.append(" ATTACHED read-only ", "bold black on cyan")
            left.append(" ")
        left.append(s.run_name, "bold")
        left.append(f" · {s.model}")
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        grid.add_column(justify="right", no_wrap=True)
        right = Text()
        if s.throughput.eta_s is not None:
            right.append(f"ETA {fmt.duration(s.throughput.eta_s)}  ")
        elif s.state == snap.RunState.RUNNING:
            right.append("ETA —  ", style="dim")  # not stable yet: said so, never a guess or 0
        right.append(f"{'' if narrow and s.attached else 'elapsed '}{fmt.clock(s.elapsed_s)} ", style="bold")
        runs = len(s.timeline.runs)
        if runs > 1 and narrow:
            right.append(f"(run {runs}) ", style="dim")
        elif runs > 1:
            # A resumed run's clock starts again: say so, and when the directory's first run began.
            right.append(f"(run {runs}, first {fmt.wall_time(s.first_started_at)[:5]}) ", style="dim")
        grid.add_row(left, right)
        return grid


class AlertBar(Panel):
    """The engine's alert, on a line of its own so it cannot be missed, else why the run waits (an
    outage, every request backing off), and once the run has ended how it ended, with its counts;
    hidden when there is none of them."""

    FRAMED = False

    @staticmethod
    def _line(s: RunSnapshot) -> str:
        return f" ⚠ {s.alert}" if s.alert else f" WAITING: {s.waiting}" if s.waiting else ""

    def key(self, s: RunSnapshot) -> Any:
        return (self._line(s), s.ended)

    def shape(self, s: RunSnapshot) -> Any:
        return (self._line(s), s.ended)  # it may wrap

    def wanted(self, s: RunSnapshot) -> bool:
        return bool(self._line(s) or s.ended)

    def draw(self, s: RunSnapshot) -> RenderableType:
        self.set_class(not s.alert and s.state == snap.RunState.DONE, "-done")
        self.set_class(not s.alert and bool(s.ended) and s.state != snap.RunState.DONE, "-incomplete")
        hint = "" if s.state == snap.RunState.DONE else " · run again to resume the rest"
        first = [self._line(s)] if self._line(s) else []
        lines = first + ([f" ■ run {s.ended}{hint}"] if s.ended else [])
        return Text("\n".join(lines), style="bold")
