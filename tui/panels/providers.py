"""Providers: share of answers per provider (with its quantization where known) and, once answers are
reconstructed, the share whose token count equals the billed one; a provider whose counts depart from
the others' is marked (`draftgen tokens` prints why, with the `ignore` line to add). A fleet's servers
([api] base_url a list) are its rows, each named by its URL, with its own adaptive limit after its share
("≤100"; yellow while a 429 storm of its own holds it below its configured value); one taken out is
marked "out"."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.core.tokens.fidelity import UNKNOWN
from draftgen.tui import fmt
from draftgen.tui.panels.panel import DrillKind, SelectablePanel


class ProvidersPanel(SelectablePanel):
    TITLE = "providers"
    WHAT = DrillKind.PROVIDER

    def items(self, s: RunSnapshot) -> tuple[str, ...]:
        room = max(1, self.rows)
        shown = s.providers if len(s.providers) <= room else s.providers[:room - 1]
        return tuple(name for name, _ in shown)

    def key(self, s: RunSnapshot) -> Any:
        return s.providers, s.fidelity, _out(s), _limits(s)

    def fit(self) -> Any:
        return (self.rows, self.cols < 26)

    def draw(self, s: RunSnapshot) -> RenderableType:
        if not s.providers:
            return Text("no answers yet", style="dim")
        total = sum(n for _, n in s.providers)
        table = Table.grid(expand=True, padding=(0, 0, 0, 1))
        table.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_column(justify="right", no_wrap=True)
        fidelity = {f.name: f for f in s.fidelity}
        # Too narrow for the agreement column (80 columns): names first; a flagged provider keeps its "!".
        narrow = self.cols < 26
        flagged = {f.name for f in s.fidelity if f.flagged}
        out = _out(s)
        limits = _limits(s)
        if narrow:
            fidelity = {}
        if fidelity:
            table.add_column(justify="right", no_wrap=True)  # answer tokens exact
        room = max(1, self.rows)
        shown = s.providers if len(s.providers) <= room else s.providers[:room - 1]
        for name, n in shown:
            unflagged = name not in flagged and not (name == "unknown" and UNKNOWN in flagged)
            label = Text(name) if not (narrow and not unflagged) else Text.assemble(("! ", "bold red"), name)
            if name in out:  # a fleet's server taken out ([api] base_url a list): events.log says why
                label = Text.assemble(("out ", "bold red"), label)
            share: Any = fmt.percent(n, total)
            if name in limits:  # a fleet's server: its own adaptive limit
                now, configured = limits[name]
                share = Text.assemble(share, " ", (f"≤{now:,}", "yellow" if now < configured else "dim"))
            cells: list[Any] = [label, share]
            if fidelity:
                # The run names a server's answers without a provider "unknown", the report "(unknown)".
                f = fidelity.get(name) or (fidelity.get(UNKNOWN) if name == "unknown" else None)
                exact = "" if f is None or f.answer_exact is None else f"exact {f.answer_exact:.0%}"
                cells.append(Text(f"! {exact}", style="bold red") if f is not None and f.flagged else exact)
            table.add_row(*cells, style="reverse" if name == self.selected else None)
        rest = s.providers[len(shown):]
        if rest:
            table.add_row(Text(f"+{len(rest)} others", style="dim"), fmt.percent(sum(n for _, n in rest), total),
                          *([""] if fidelity else []))
        return table


def _limits(s: RunSnapshot) -> dict[str, tuple[int, int]]:
    """The fleet's servers' adaptive limits: name -> (now, configured)."""
    return {p.name: (p.limit, p.limit_configured) for p in s.provider_stats if p.server and p.limit}


def _out(s: RunSnapshot) -> frozenset[str]:
    """The fleet's servers taken out now."""
    return frozenset(p.name for p in s.provider_stats if p.out)
