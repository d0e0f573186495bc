"""Throughput: request and token rates over the recent window and since the start, side by side.

The reference run's operator read a running average (2,284 tokens) for the recent one (~5,300):
every figure here sits under a column header that names its window.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui import fmt
from draftgen.tui.panels.panel import Panel

# Labels by the panel's content width: spelled out where there is room, short where not.
LABELS = ((46, ("requests/s", "completion tokens/s", "avg tokens per answer")),
          (37, ("requests/s", "tokens/s", "avg tok/answer")),
          (0, ("req/s", "tok/s", "avg tok")))


def _labels(cols: int) -> tuple[str, str, str]:
    return next(labels for width, labels in LABELS if cols >= width)


ROWS = 7  # the column headers, three rates, in flight with the limit, the limit alone, the sparkline


def _flight(in_flight: int, effective: int, configured: int, cols: int) -> Text:
    """What is in flight and the limit, the configured value always whole (never "limit 1,780 o…"): on
    one line where it fits, else the limit on a line of its own; the "(429 back-off)" note only where
    there is room for it."""
    flight = Text.assemble("in flight ", (fmt.count(in_flight), "bold"))
    limit = Text("limit ")
    if effective < configured:  # backed off after 429s: how far, effective of configured
        limit.append(f"{fmt.count(effective)} of {fmt.count(configured)}", style="bold yellow")
    else:
        limit.append(fmt.count(configured))
    noted = limit + " (429 back-off)" if effective < configured else limit
    for line in (noted, limit):
        if len(flight) + 2 + len(line) <= cols:
            return Text.assemble(flight, ", ", line, no_wrap=True, overflow="ellipsis")
    lines = Text("\n").join([flight, noted if len(noted) <= cols else limit])
    lines.no_wrap = True
    lines.overflow = "ellipsis"
    return lines


class ThroughputPanel(Panel):
    TITLE = "throughput"

    def key(self, s: RunSnapshot) -> Any:
        return s.throughput

    def fit(self) -> Any:
        # the labels and where the limit goes depend on the width, the sparkline on a row left for it
        return self.cols, self.content_region.height

    def draw(self, s: RunSnapshot) -> RenderableType:
        t = s.throughput
        req, tok, avg = _labels(self.cols)
        table = Table(box=None, expand=True, padding=(0, 0, 0, 1), pad_edge=False, show_edge=False,
                      header_style="bold")
        table.add_column("", no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_column(f"last {t.window_s:g} s", justify="right", no_wrap=True)
        table.add_column("since start", justify="right", no_wrap=True)
        table.add_row(req, fmt.rate(t.req_s_window), fmt.rate(t.req_s_total))
        table.add_row(tok, fmt.count(t.tok_s_window),
                      fmt.count(t.tok_s_total))
        table.add_row(avg,
                      fmt.count(t.avg_completion_tokens_window), fmt.count(t.avg_completion_tokens_total))

        flight = _flight(t.in_flight, t.effective_concurrency, t.configured_concurrency, self.cols)

        # One bar per second, newest on the right, scaled to the peak named in its label.
        spark = Table.grid(expand=True, padding=(0, 1, 0, 0), pad_edge=False)
        spark.add_column(no_wrap=True)
        spark.add_column(ratio=1)
        spark.add_row(Text(f"req/s ≤{fmt.rate(max(t.history, default=0.0))}", style="dim"),
                      fmt.Spark(t.history, style="green"))
        if len(flight.plain.splitlines()) > 1 and 0 < self.content_region.height < ROWS:
            return Group(table, flight)  # a short screen: the limit before the sparkline (h shows the history)
        return Group(table, flight, spark)
