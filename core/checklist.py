"""The pass/fail table `draftgen smoke` and `draftgen extract --self-check` print (rich, for the CLI)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def checklist_table(title: str, rows: Iterable[tuple[str, bool, str] | tuple[str, bool, str, bool]]) -> Any:
    """A rich Table: check, PASS/FAIL (WARN: passed, worth reading, when a row's 4th item is true),
    detail. Details are escaped: they quote upstream text."""
    from rich.markup import escape
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for row in rows:
        check, passed, detail = row[:3]
        warn = len(row) > 3 and bool(row[3])
        verdict = "[yellow]WARN[/]" if passed and warn else "[green]PASS[/]" if passed else "[bold red]FAIL[/]"
        table.add_row(escape(check), verdict, escape(detail))
    return table
