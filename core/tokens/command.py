"""`draftgen tokens CONFIG`: reconstruct every dataset on disk with a progress bar, then print the
validation report."""

from __future__ import annotations

from typing import Any

from draftgen.core.config import Config
from draftgen.core.files import exclusive
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible
from draftgen.core.tokens.reconstruct import CHECKS
from draftgen.core.tokens.report import PROVIDER_CAPTION, PROVIDER_COLUMNS, ValidationReport, provider_rows
from draftgen.core.tokens.workers import REPORT_FILE, cores, provider_flags, reconstruct_dataset, worker_pool


def tokens_command(config: Config) -> int:
    """`draftgen tokens CONFIG`: reconstruct every dataset, print the validation report. Refused while
    a run is live in the run directory (its live reconstruction writes the same token folders)."""
    with exclusive(config.run_dir, "draftgen tokens"):
        return _tokens(config)


def _tokens(config: Config) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar
    from rich.table import Table

    console = Console()
    reports = []
    workers = config.engine.workers or cores()
    pool = worker_pool(config, workers) if workers > 1 else None  # one pool for every dataset
    try:
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                 console=console, transient=True) as bar:
            for ds in config.datasets:
                task = bar.add_task(escape(ds.name), total=None)

                def show(p: StageProgress, task: Any = task) -> None:
                    bar.update(task, completed=p.done, total=p.total or None)
                reports.append(reconstruct_dataset(config, ds.name, show, workers=workers, pool=pool))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # Names and paths are the user's text, not rich markup ("B[/x]" must print, not raise); a provider's
    # name is read from the records, written by any version: shown with its controls escaped.
    table = Table(title=f"token reconstruction — {escape(visible(str(config.run_dir)))}", box=None, header_style="bold")
    table.add_column("dataset", no_wrap=True)
    for col in ("answers", "valid", "invalid", "trunc.", "Δ mean", "p50 |Δ|", "p99 |Δ|", "exact"):
        table.add_column(col, justify="right", no_wrap=True)
    total = ValidationReport.combine(reports)
    for i, r in enumerate([*reports, total]):
        counted = r.counted > 0
        table.add_row(escape(r.name), f"{r.checked:,}", f"{r.valid:,}", f"{r.checked - r.valid:,}", f"{r.truncated:,}",
                      f"{r.diff_mean:+.2f}" if counted else "-",
                      str(r.diff_abs_percentile(50)) if counted else "-",
                      str(r.diff_abs_percentile(99)) if counted else "-",
                      f"{r.share_exact:.1%}" if counted else "-", end_section=i == len(reports) - 1)
    console.print(table)
    for r in reports:
        _print_dataset(console, r)
    named = {p: a for p, a in total.providers.items() if a.answers}
    if named:
        per = Table(title="agreement per provider", caption=PROVIDER_CAPTION, box=None, header_style="bold")
        for j, col in enumerate(PROVIDER_COLUMNS):
            per.add_column(col, justify="left" if j == 0 else "right", no_wrap=True)
        for row in provider_rows(named):
            per.add_row(escape(visible(row[0])), *row[1:])
        console.print(per)
    for flag in provider_flags(config, total):
        # soft_wrap: the lines to paste stay whole however narrow the terminal.
        console.print(f"[bold red]FLAGGED[/] {escape(visible(flag.provider))}: {escape(visible(flag.reason))}")
        if flag.absolute:
            console.print(f"  to change: {escape(visible(flag.fix))}", soft_wrap=True)
            console.print("  merge drops its samples (" + escape("[validation] drop_flagged_sources = false")
                          + " keeps them)", soft_wrap=True)
            continue
        if flag.ignore_line:
            console.print(f"  to stop sending it requests, in {escape('[request.provider]')}: "
                          f"{escape(flag.ignore_line)}", soft_wrap=True)
        else:  # a fleet's server
            console.print(f"  to change: {escape(visible(flag.fix))}", soft_wrap=True)
        console.print(f"  to leave its answers out of merge, in {escape('[merge]')}: {escape(flag.exclude_line)}",
                      soft_wrap=True)
    console.print("Δ = reconstructed answer tokens - billed completion_tokens. Reports: "
                  f"{escape(str(RunDir(config.run_dir).root))}/<dataset>/tokens/{REPORT_FILE}")
    return 0


def _print_dataset(console: Any, r: ValidationReport) -> None:
    """One dataset's failed checks, prompt agreement, tool-call ids and sample policy."""
    from rich.markup import escape
    failed = ", ".join(f"{c} {r.failures[c]:,}" for c in CHECKS if r.failures.get(c))
    if failed:
        console.print(f"{escape(r.name)}: failed checks: {failed}")
    prompt = r.prompt
    if prompt.n:
        console.print(f"{escape(r.name)}: prompt tokens equal to usage.prompt_tokens in {prompt.share_exact:.1%} "
                      f"of {prompt.n:,} ({r.prompt_mismatches:,} differ)")
    if r.prompt_from_backend:
        console.print(f"{escape(r.name)}: {r.prompt_ids_line()}")
    if tools_line := r.tool_ids_line():  # provider names come from the records: controls escaped
        console.print(f"{escape(r.name)}: {escape(visible(tools_line))}")
    dropped = ", ".join(f"{k} {n:,}" for k, n in sorted(r.dropped.items()) if n) or "nothing"
    noted = ", ".join(f"{k} {n:,}" for k, n in sorted(r.noted.items()) if n)
    console.print(f"{escape(r.name)}: the sample policy keeps {r.kept:,}" + (f" ({noted})" if noted else "")
                  + f", drops {dropped}")
