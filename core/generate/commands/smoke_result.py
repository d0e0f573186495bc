"""The smoke test's result (its rows, the cost of each shape's request, the projection, the stream mode it
decided) as smoke.json keeps it, and its printout for `draftgen smoke`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from draftgen.core.generate.commands.smoke_rows import SmokeRow
from draftgen.core.generate.money.forecast import RunForecast, SmokeFigures
from draftgen.core.units import clip, usd


@dataclass
class SmokeResult:
    fingerprint: str
    rows: list[SmokeRow] = field(default_factory=list)
    cost_per_request: dict[str, float] = field(default_factory=dict)  # dataset name -> $ of its smoke request
    projected_cost_usd: float | None = None
    balance_usd: float | None = None
    projection: RunForecast | None = None
    smoke_answer: SmokeFigures | None = None  # the projection's pace and price before a run has answers
    stream: bool | None = None  # the mode that keeps a self-hosted server's text (True: streamed); None: not known

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def summary(self) -> str:
        """One line: the count, and each failed check with its cause ("key (cannot connect to …)")."""
        failed = [r for r in self.rows if not r.passed]
        head = f"{len(self.rows) - len(failed)}/{len(self.rows)} checks passed"
        if not failed:
            return head
        # Cut at a word: the whole detail is in the checklist table and smoke.json.
        return head + "; failed: " + ", ".join(f"{r.check} ({clip(r.detail, 160)})" for r in failed)

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "passed": self.passed, "checked_at": time.time(),
                "rows": [{"check": r.check, "passed": r.passed, "detail": r.detail, "warning": r.warning}
                         for r in self.rows],
                "cost_per_request": self.cost_per_request, "projected_cost_usd": self.projected_cost_usd,
                "balance_usd": self.balance_usd, "stream": self.stream,
                "smoke_answer": None if self.smoke_answer is None else dataclasses.asdict(self.smoke_answer)}


def print_result(result: SmokeResult) -> None:
    from rich.console import Console
    from rich.markup import escape

    from draftgen.core.checklist import checklist_table
    console = Console()
    # Details quote the upstream (answers, error bodies): "[/INST]" there is text, not rich markup.
    console.print(checklist_table("draftgen smoke test", ((r.check, r.passed, r.detail, r.warning)
                                                          for r in result.rows)))
    for name, cost in result.cost_per_request.items():
        console.print(f"cost per request ({escape(name)}): {usd(cost)}")
    if result.projection is not None:
        console.print(f"projected run cost, every dataset: {escape(result.projection.describe())}")
        for d in result.projection.datasets:
            console.print(f"  {escape(d.name)}: {d.answers_left} answers of ~{d.tokens_per_answer:.0f} tokens "
                          f"({d.basis}): {usd(d.cost_usd)} ({usd(d.low_usd)}-{usd(d.high_usd)})"
                          + (f", ~{d.time_s / 60:.0f} min" if d.time_s is not None else ""))
    console.print(("[green]PASSED[/]: " if result.passed else "[bold red]FAILED[/]: ") + escape(result.summary()))
