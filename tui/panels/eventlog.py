"""Event log: the run's recent events, newest at the bottom, wrapped to the panel's width.

Only the newest events that fit are drawn (the full history is in the run's events.log), so the
panel re-wraps cleanly on resize and needs no scrolling.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from draftgen.core.live.snapshot import Event

from draftgen.tui import fmt

LEVEL_STYLES = {"info": "", "warn": "bold yellow", "error": "bold red"}
PREFIX = 15  # "HH:MM:SS level " before each message; wrapped lines indent under the message


class EventLogPanel(Widget):
    DEFAULT_CSS = "EventLogPanel { height: 1fr; }"

    def __init__(self, *, id: str | None = None, keep: int = 500) -> None:
        super().__init__(id=id, classes="panel")
        self.border_title = "events"
        self.events: deque[Event] = deque(maxlen=keep)

    @property
    def lines(self) -> list[str]:
        """The log as plain one-line texts (what a test or a copy would want)."""
        return [f"{fmt.wall_time(e.ts)} {e.level:<5} {e.message}" for e in self.events]

    def add(self, events: Iterable[Event]) -> None:
        self.events.extend(events)
        self.refresh()

    def render(self) -> RenderableType:
        width, height = self.content_region.width, self.content_region.height
        if not self.events:
            return Text("no events yet", style="dim")
        if width <= PREFIX or height <= 0:
            return Text("")
        shown: list[tuple[Event, Text]] = []
        used = 0
        for e in reversed(self.events):
            message = Text(e.message, style="red" if e.level == "error" else "")
            rows = len(message.wrap(self.app.console, width - PREFIX))
            if used + rows > height:
                break
            shown.append((e, message))
            used += rows
        grid = Table.grid(expand=True, padding=(0, 1, 0, 0))
        grid.add_column(style="dim", no_wrap=True, width=8)
        grid.add_column(no_wrap=True, width=5)
        grid.add_column(ratio=1)
        for e, message in reversed(shown):
            grid.add_row(fmt.wall_time(e.ts), Text(e.level, style=LEVEL_STYLES.get(e.level, "")), message)
        return grid
