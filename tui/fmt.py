"""How numbers read on screen: counts, tokens, dollars, durations, bars.

Every panel formats through here so that the same quantity looks the same everywhere.
"""

from __future__ import annotations

import time

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.style import Style

from draftgen.core.units import clock, duration, usd

__all__ = ["Bar", "Spark", "clock", "count", "duration", "percent", "rate", "sparkline", "tokens", "usd", "wall_time"]

_EIGHTHS = " ▏▎▍▌▋▊▉"
_SPARKS = "▁▂▃▄▅▆▇█"


def count(n: float) -> str:
    return f"{n:,.0f}"


def tokens(n: float | None) -> str:
    """Token counts in the units a budget is thought of: 950, 512k, 9.84M."""
    if n is None:
        return "—"
    n = float(n)
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            v = n / scale
            # Three significant digits, never rounded up past what was used (9.996M is not 10.0M).
            digits = 2 if v < 10 else 1 if v < 100 else 0
            v = int(v * 10 ** digits + 1e-6) / 10 ** digits
            return f"{v:.{digits}f}{unit}"
    return f"{n:.0f}"


def rate(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def wall_time(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "—"


class Bar:
    """A progress bar that fills its table cell, drawn in block characters so it reads without colour."""

    def __init__(self, fraction: float, *, style: str = "", empty_style: str = "dim", label: str = "",
                 min_width: int = 6, max_width: int = 48) -> None:
        self.fraction = min(1.0, max(0.0, fraction))
        self.label = label
        self.style = style
        self.empty_style = empty_style
        self.min_width = min_width
        self.max_width = max_width

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        extra = len(self.label) + 1 if self.label else 0
        return Measurement(self.min_width + extra, self.max_width + extra)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        extra = len(self.label) + 1 if self.label else 0
        width = max(1, min(options.max_width - extra, self.max_width))
        eighths = round(self.fraction * width * 8)
        full, part = divmod(eighths, 8)
        filled = "█" * full + (_EIGHTHS[part] if part else "")
        yield Segment(filled, Style.parse(self.style) if self.style else None)
        # Light shade for the rest: the unfinished part is visible in NO_COLOR too.
        yield Segment("░" * (width - len(filled)), Style.parse(self.empty_style))
        if self.label:
            yield Segment(" " + self.label.rjust(extra - 1))


class Spark:
    """A sparkline filling its cell: one bar per value, newest on the right, zero-based so that a
    steady rate looks steady (a min-to-max scale would blow up noise)."""

    def __init__(self, values: tuple[float, ...], *, style: str = "") -> None:
        self.values = values
        self.style = style

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, max(8, len(self.values)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        line = sparkline(self.values, width)
        yield Segment(line.rjust(width), Style.parse(self.style) if self.style else None)


def sparkline(values: tuple[float, ...] | list[float], width: int) -> str:
    """The last `width` values as bars from zero to the maximum; a zero is a blank."""
    values = list(values)[-width:] if width > 0 else []
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return " " * len(values)
    return "".join(_SPARKS[min(7, int(v / top * 7.999))] if v > 0 else " " for v in values)
