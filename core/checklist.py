"""The pass/fail table `draftgen smoke` and `draftgen extract --self-check` print (rich, for the CLI)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def checklist_table(title: str, rows: Iterable[tuple[str, bool, str]]) -> Any:
    """A rich Table: check, PASS/FAIL, detail. Details are escaped: they quote upstream text."""
    from rich.markup import escape
    from rich.table import Table
    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for check, passed, detail in rows:
        table.add_row(escape(check), "[green]PASS[/]" if passed else "[bold red]FAIL[/]", escape(detail))
    return table
