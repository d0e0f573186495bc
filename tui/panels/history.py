"""History beside the tables on wide screens: requests/s and tokens/s over the whole run (h shows
every chart)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui.charts import CHARTS, Chart
from draftgen.tui.panels.panel import Panel


class HistoryPanel(Panel):
    TITLE = "history (h)"

    def key(self, s: RunSnapshot) -> Any:
        return s.timeline

    def fit(self) -> Any:
        return (self.rows, self.cols)

    def draw(self, s: RunSnapshot) -> RenderableType:
        shown = CHARTS[:2]
        height = max(1, (self.rows - 1) // len(shown) - 1)
        return Group(*(Chart(s.timeline, series, title, value, style, height=height, axis=i == len(shown) - 1)
                       for i, (series, title, value, style) in enumerate(shown)))
