"""`draftgen merge CONFIG`: the merge run headless, a progress line about once a second, then its
tables (per dataset, dropped by reason, turns by number) and what the merge noted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.live.progress import every
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.merge import contamination
from draftgen.core.merge.merge import merge
from draftgen.core.merge.stats import DROP_REASONS, DatasetMergeStats, MergeStats
from draftgen.core.merge.turns import AGENT_FLAGS
from draftgen.core.safe_text import visible
from draftgen.core.tokens.policy import NOTES
from draftgen.core.units import usd, usd_shown


def _turns_table(stats: MergeStats) -> Any:
    """Turns of multi-turn conversations by turn number: read, kept, dropped by reason."""
    from rich.markup import escape
    from rich.table import Table
    by_turn = stats.by_turn
    reasons = sorted({r for row in by_turn.values() for r in row["dropped"]}, key=DROP_REASONS.index)
    flags = [f for f in AGENT_FLAGS if any(row.get(f) for row in by_turn.values())]  # agent steps only
    table = Table(title=escape(f"turns of conversations ([merge] multi_turn = \"{stats.multi_turn}\")"))
    for col in ("turn", "read", "kept", *reasons, *flags):
        table.add_column(col, justify="right")
    for k, row in by_turn.items():
        table.add_row(k, f"{row['read']:,}", f"{row['kept']:,}", *(f"{row['dropped'].get(r, 0):,}" for r in reasons),
                      *(f"{row.get(f, 0):,}" for f in flags))
    return table



def _print_turns_and_contamination(console: Any, stats: MergeStats) -> None:
    """The table of turns by number (multi-turn datasets) and the contamination filter's line, when there are."""
    from rich.markup import escape
    if stats.by_turn:
        console.print(_turns_table(stats))
    if stats.contamination:
        console.print(escape(contamination_line(stats)), soft_wrap=True, highlight=False)


def contamination_line(stats: MergeStats) -> str:
    """The contamination filter's drops by benchmark, and where the matches are (merge's output, the event)."""
    counts = stats.contamination.get("dropped", {})
    by = ", ".join(f"{visible(name)} {n:,}" for name, n in counts.items())
    return (f"contaminated (left out, by benchmark): {by}; matches in "
            f"{visible(str(Path(stats.output_dir) / contamination.REPORT_FILE))}")


def merge_command(config: Config, *, replace_hidden_states: bool = False) -> int:
    """Headless merge: a progress line about once a second, then a summary table. Returns 0."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    def show(p: StageProgress) -> None:
        counts = "  ".join(f"{k} {int(v):,}" for k, v in p.detail)
        pct = f"{100 * p.done / p.total:5.1f}%" if p.total else "     "
        print(f"merge {p.state:8} {pct}  {p.message:<24}  {counts}", flush=True)

    stats = merge(config, every(1.0, show), replace_hidden_states=replace_hidden_states)
    # The total row is the sum of the rows as shown (units.usd_shown), as in the run's summary.
    totals = DatasetMergeStats("total", stats.read, stats.samples, stats.dropped, {}, stats.tokens,
                               stats.masked_tokens, sum(usd_shown(d.cost_usd) for d in stats.datasets),
                               sum(usd_shown(d.cost_all_usd) for d in stats.datasets))
    rows = [*stats.datasets, totals]
    # Names and paths are the user's text, not rich markup ("B[/x]" must print, not raise).
    table = Table(title=f"merged → {escape(visible(stats.output_dir))} (seed {stats.seed})")
    # Costs from the spend ledger: "spent" is the dataset's figure in the run's views and report.
    for col in ("dataset", "read", "kept", "dropped", "tokens", "masked", "kept cost", "spent"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for d in rows:
        table.add_row(escape(d.name), f"{d.read:,}", f"{d.kept:,}", f"{d.dropped_total:,}", f"{d.tokens:,}",
                      f"{d.masked_tokens:,}", usd(d.cost_usd), usd(d.cost_all_usd), end_section=d is stats.datasets[-1])
    console.print(table)
    reasons = [r for r in DROP_REASONS if totals.dropped[r]]
    if reasons:
        drops = Table(title="dropped by reason")
        drops.add_column("dataset")
        for r in reasons:
            drops.add_column(r, justify="right")
        for d in rows:
            drops.add_row(escape(d.name), *(f"{d.dropped[r]:,}" for r in reasons), end_section=d is stats.datasets[-1])
        console.print(drops)
    _print_turns_and_contamination(console, stats)
    checks: dict[str, int] = {}
    for d in stats.datasets:
        for check, n in d.invalid_checks.items():
            checks[check] = checks.get(check, 0) + n
    if checks:
        console.print("invalid by check: " + ", ".join(f"{c} {n:,}" for c, n in sorted(checks.items())))
    noted = {n: sum(d.kept_noted.get(n, 0) for d in stats.datasets) for n in NOTES}
    if any(noted.values()):
        console.print("kept although they differed: " + ", ".join(f"{n} {c:,}" for n, c in noted.items() if c)
                      + " (see \\[validation] in docs/config.md)", highlight=False)
    for d in stats.datasets:
        for f in d.flagged_sources:
            what = "dropped" if f["dropped"] else "kept ([validation] drop_flagged_sources = false)"
            # The provider's name is the records' (an earlier version may have stored it raw): made safe here.
            console.print(f"[bold red]FLAGGED[/] {escape(d.name)} {escape(visible(f['provider']))}: "
                          f"{escape(visible(f['reason']))}; its samples {escape(what)}. To change: "
                          f"{escape(visible(f['fix']))}", soft_wrap=True, highlight=False)
    console.print(f"{stats.samples:,} samples written in {stats.elapsed_s:.1f} s (merge {stats.merge_id})",
                  highlight=False)
    if stats.hidden_states:
        console.print(escape(stats.hidden_states), soft_wrap=True, highlight=False)
    sys.stdout.flush()
    return 0
