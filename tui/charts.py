"""Charts of the run's history, drawn with block characters so they read over SSH, in tmux and
without colour: one column per slice of time, eighth-blocks for height, zero at the bottom, the
peak on the axis, and the time span under it.

Used by the history view, the wide main screen and `draftgen report` (plain rich renderables).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style

from draftgen.core.live.snapshot import Timeline
from draftgen.tui import fmt

_EIGHTHS = " ▁▂▃▄▅▆▇█"

# The charts of the history view: series name, title, how a value reads, colour.
CHARTS: tuple[tuple[str, str, Callable[[float], str], str], ...] = (
    ("req_s", "requests/s", lambda v: fmt.rate(v), "green"),
    ("tok_s", "completion tokens/s", lambda v: fmt.count(v), "cyan"),
    ("usd_min", "spend per minute", lambda v: fmt.usd(v), "yellow"),
    ("error_pct", "errors, % of attempts", lambda v: f"{v:.1f}%", "red"),
    ("in_flight", "requests in flight", lambda v: fmt.count(v), "magenta"),
)


def fit(values: Sequence[float], width: int) -> list[float]:
    """`values` spread over exactly `width` columns: averaged in buckets when there are more, each
    value repeated across its share of the columns when there are fewer."""
    n = len(values)
    if n == 0 or width <= 0:
        return []
    if n <= width:
        return [values[min(n - 1, col * n // width)] for col in range(width)]
    out = []
    for col in range(width):
        lo, hi = col * n // width, max(col * n // width + 1, (col + 1) * n // width)
        chunk = values[lo:hi]
        out.append(sum(chunk) / len(chunk))
    return out


def bars(values: Sequence[float], width: int, height: int, top: float | None = None) -> list[str]:
    """Rows of block characters, top row first, `width` columns of `height` rows each."""
    cols = fit(values, width)
    top = max(cols, default=0.0) if top is None else top
    rows = []
    for row in range(height - 1, -1, -1):
        line = []
        for v in cols:
            eighths = round(v / top * height * 8) if top > 0 else 0
            if v > 0 and eighths == 0:
                eighths = 1  # something happened: never drawn as nothing
            line.append(_EIGHTHS[max(0, min(8, eighths - row * 8))])
        rows.append("".join(line))
    return rows


def span_label(timeline: Timeline) -> tuple[str, str]:
    """Wall-clock times at the left and right ends of the charts."""
    if not timeline.points:
        return "", ""
    first = timeline.points[0][0]
    last = timeline.points[-1][0] + timeline.interval_s
    day = 24 * 3600
    pattern = "%H:%M" if last - first < day else "%a %H:%M"
    return time.strftime(pattern, time.localtime(first)), time.strftime(pattern, time.localtime(last))


class Chart:
    """One series as a block chart with its title, latest and peak values, and the time span."""

    def __init__(self, timeline: Timeline, series: str, title: str, value: Callable[[float], str],
                 style: str = "", *, height: int = 4, axis: bool = True) -> None:
        self.timeline = timeline
        self.values = timeline.series(series)
        self.title = title
        self.value = value
        self.style = style
        self.height = max(1, height)
        self.axis = axis

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(20, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        peak = max(self.values, default=0.0)
        now = self.values[-1] if self.values else 0.0
        mean = sum(self.values) / len(self.values) if self.values else 0.0
        # As much of the head as fits, never a figure cut in half.
        heads = (f"{self.title}  now {self.value(now)}  mean {self.value(mean)}  peak {self.value(peak)}",
                 f"{self.title}  now {self.value(now)}  peak {self.value(peak)}",
                 f"{self.title}  now {self.value(now)}", self.title)
        head = next((h for h in heads if len(h) <= width), self.title[:width])
        yield Segment(head.ljust(width), Style(bold=True))
        yield Segment.line()
        gutter = 9 if width >= 40 else 0
        plot_w = width - gutter
        if not self.values:
            yield Segment("no history yet: a point every few seconds".ljust(width)[:width], Style(dim=True))
            yield Segment.line()
            return
        rows = bars(self.values, plot_w, self.height, peak)
        style = Style.parse(self.style) if self.style else None
        for i, row in enumerate(rows):
            if gutter:
                label = self.value(peak) if i == 0 else ("0" if i == len(rows) - 1 else "")
                yield Segment(label[:gutter - 2].rjust(gutter - 2) + " ┤", Style(dim=True))
            yield Segment(row, style)
            yield Segment.line()
        if self.axis:
            left, right = span_label(self.timeline)
            gap = plot_w - len(left) - len(right)
            line = (left + " " * gap + right) if gap > 0 else left[:plot_w]
            yield Segment(" " * gutter + line, Style(dim=True))
            yield Segment.line()
