"""Stages: progress of the one-shot stages (smoke, tokens, merge, extract) once they have started."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot, StageProgress, StageState
from draftgen.tui import fmt
from draftgen.tui.panels.panel import Panel

STATE_STYLES = {StageState.RUNNING: "bold green", StageState.DONE: "bold blue", StageState.FAILED: "bold red",
                StageState.STOPPED: "bold yellow"}


def active_stages(s: RunSnapshot) -> tuple[StageProgress, ...]:
    return tuple(st for st in s.stages if st.state != StageState.IDLE)


def _progress(st: StageProgress) -> RenderableType:
    if st.checks:
        passed = sum(1 for _, ok, _ in st.checks if ok)
        text = Text(f"{passed}/{len(st.checks)} passed")
        if passed < len(st.checks):
            text.append(f", {len(st.checks) - passed} failed", style="bold red")
        return text
    if not st.total:
        return Text(fmt.count(st.done) if st.done else "")
    return fmt.Bar(st.done / st.total, style="green", label=fmt.percent(st.done, st.total).rjust(4), max_width=60)


def _row(st: StageProgress) -> Table:
    # One grid per stage with fixed leading columns, so that stages line up and a detail line can
    # sit under its own stage.
    grid = Table.grid(expand=True, padding=(0, 1, 0, 0))
    grid.add_column(no_wrap=True, width=7)
    grid.add_column(no_wrap=True, width=7)
    grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    grid.add_column(justify="right", no_wrap=True, width=13, overflow="ellipsis")
    grid.add_column(justify="right", no_wrap=True, width=23, overflow="ellipsis")
    counts = f"{fmt.count(st.done)}/{fmt.count(st.total)}" if st.total and not st.checks else ""
    pace = ""
    if st.state == StageState.RUNNING and st.rate:
        unit = st.rate_unit.strip()
        pace = f"{fmt.rate(st.rate)}{unit}" if unit.startswith("/") else f"{fmt.rate(st.rate)} {unit}"
        if st.eta_s is not None:
            pace += f" ETA {fmt.duration(st.eta_s)}"
    grid.add_row(Text(st.name, style="bold"), Text(st.state, style=STATE_STYLES.get(st.state, "")),
                 _progress(st), counts, pace)
    return grid


class StagesPanel(Panel):
    TITLE = "stages"

    def key(self, s: RunSnapshot) -> Any:
        return active_stages(s)

    def fit(self) -> Any:
        return self.short

    def shape(self, s: RunSnapshot) -> Any:
        # The detail line wraps rather than cut words (the validation figures are at its end): its
        # height follows its length.
        return tuple((st.name, st.state, len(self._notes(st)) // max(1, self.cols - 8)) for st in active_stages(s))

    @staticmethod
    def _notes(st: StageProgress) -> str:
        if st.state not in (StageState.RUNNING, StageState.FAILED, StageState.STOPPED):
            return ""
        return " · ".join([f"{k} {v}" for k, v in st.detail] + ([st.message] if st.message else []))

    def _shown(self, s: RunSnapshot) -> tuple[StageProgress, ...]:
        stages = active_stages(s)
        if self.short:
            # 80x24: only what is running or failed, one line each.
            stages = tuple(st for st in stages if st.state in (StageState.RUNNING, StageState.FAILED))
        return stages

    def wanted(self, s: RunSnapshot) -> bool:
        return bool(self._shown(s))

    def draw(self, s: RunSnapshot) -> RenderableType:
        stages = self._shown(s)
        parts: list[RenderableType] = []
        for st in stages:
            parts.append(_row(st))
            # Details only while a stage runs or when it failed: finished stages keep to one line.
            notes = self._notes(st)
            if notes and not self.short:
                grid = Table.grid(expand=True)
                grid.add_column(width=8)
                grid.add_column(ratio=1)
                grid.add_row("", Text(notes, style="dim"))
                parts.append(grid)
        return Group(*parts)
