"""Credits: the balance with its age (a balance read once goes stale), spend, projection, limits."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui import fmt
from draftgen.tui.panels.panel import Panel


class CreditsPanel(Panel):
    TITLE = "credits"

    def fit(self) -> Any:
        return self.cols < 30

    def key(self, s: RunSnapshot) -> Any:
        c = s.credits
        # The age ticks every snapshot; whole seconds are all it shows.
        return (c.balance_usd, None if c.balance_age_s is None else int(c.balance_age_s), c.spent_usd,
                c.spent_total_usd, c.in_flight_usd, c.projected_total_usd, c.max_usd, c.floor_usd, c.pending_usd,
                c.balance_source, c.ceiling_limited, c.projected_low_usd, c.projected_high_usd, c.projected_capped)

    def draw(self, s: RunSnapshot) -> RenderableType:
        c = s.credits
        narrow = self.cols < 30
        table = Table.grid(expand=True, padding=(0, 0, 0, 1))
        table.add_column(no_wrap=True)
        table.add_column(justify="right", no_wrap=True, overflow="ellipsis", ratio=1)
        if c.balance_usd is None:
            # An ordinary key without a cap cannot read it: a warning, the run goes on under max_usd.
            table.add_row("balance", Text("unknown", style="yellow"))
        else:
            low = c.balance_usd - c.in_flight_usd <= c.floor_usd
            value = Text(fmt.usd(c.balance_usd), style="bold red" if low else "bold")
            if c.balance_age_s is not None:
                # 80 columns: the age in brackets, so that nothing is cut.
                age = fmt.duration(c.balance_age_s)
                value.append(f" ({age})" if narrow else f", {age} ago", style="")
            if c.balance_source == "key limit":
                value.append(" (key cap)", style="dim")
            table.add_row("balance", value)
        run, every = ("this run", "all runs") if not narrow else ("run", "all")
        table.add_row("spent", Text(f"{fmt.usd(c.spent_usd)} {run}"))
        table.add_row("", Text(f"{fmt.usd(c.spent_total_usd)} {every}"))
        if c.pending_usd:
            # "of it pending" was cut at 120x40
            table.add_row("", Text(f"{fmt.usd(c.pending_usd)} pending", style="dim"))
        table.add_row("reserved", Text(fmt.usd(c.in_flight_usd), style="bold yellow" if c.ceiling_limited else ""))
        table.add_row("max_usd", fmt.usd(c.max_usd) if c.max_usd is not None else Text("none", style="dim"))
        if c.ceiling_limited:
            table.add_row("", Text("ceiling limits concurrency", style="bold yellow"))
        table.add_row("projected", Text(fmt.usd(c.projected_total_usd), style="bold red" if c.projected_capped else ""))
        if c.projected_low_usd is not None and c.projected_high_usd is not None:
            table.add_row("", Text(f"{fmt.usd(c.projected_low_usd)}-{fmt.usd(c.projected_high_usd)}", style="dim"))
        table.add_row("floor", fmt.usd(c.floor_usd))
        return table
