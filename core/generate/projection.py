"""The engine's picture of a run: counts as they are, and what finishing will take.

What is left of a dataset is its usable prompts not yet done, failed or skipped, capped by what
its token budget still allows at the average answer length; projected cost is what it has spent
plus what is left at the observed cost per answer; the ETA is what is left over the recent rate.
"""

from __future__ import annotations

from collections.abc import Iterable

from draftgen.core.generate.ledger import DatasetRun, Ledger
from draftgen.core.live import snapshot as snap
from draftgen.core.live.snapshot import DatasetStatus, RunState


def remaining(ds: DatasetRun) -> int:
    """Answers this dataset may still ask for."""
    left = max(0, ds.total - ds.done - ds.failed - ds.skipped)
    if ds.tokens.limit is not None and ds.tokens.answers:
        by_budget = (ds.tokens.remaining() or 0) / max(1.0, ds.tokens.used / ds.tokens.answers)
        left = min(left, int(by_budget) + ds.in_flight)
    if ds.status in (DatasetStatus.BUDGET, DatasetStatus.STOPPED, DatasetStatus.DONE):
        left = ds.in_flight
    return left


def project(*, run_name: str, model: str, state: RunState, alert: str, waiting: str = "", elapsed_s: float, seq: int,
            datasets: Iterable[DatasetRun], ledger: Ledger, retries: int) -> snap.RunSnapshot:
    money, rates = ledger.money, ledger.rates
    all_ds = list(datasets)
    win_req, win_tok, win_avg = rates.window()
    tot_req, tot_tok, tot_avg = rates.total()
    shots = []
    projected_remaining = 0.0
    admissible = 0
    cost_per_answer = money.expected_cost()
    for ds in all_ds:
        left = remaining(ds)
        projected = ds.cost + left * cost_per_answer if cost_per_answer else None
        if projected is not None:
            projected_remaining += projected - ds.cost
        admissible += left
        paused = state == RunState.PAUSED and ds.status == DatasetStatus.RUNNING
        shots.append(snap.DatasetSnapshot(
            name=ds.config.name, status=DatasetStatus.PAUSED if paused else ds.status,
            total=ds.total, done=ds.done, failed=ds.failed, skipped=ds.skipped, rejected=ds.rejected,
            truncated=ds.truncated, in_flight=ds.in_flight, concurrency=ds.config.concurrency,
            effective_concurrency=ds.concurrency.limit, tokens_used=ds.tokens.used,
            tokens_in_flight=ds.tokens.in_flight, token_budget=ds.tokens.limit, cost_usd=round(ds.cost, 6),
            projected_cost_usd=None if projected is None else round(projected, 4), message=ds.message))
    active = [d for d in all_ds if d.status == DatasetStatus.RUNNING] or all_ds
    throughput = snap.Throughput(
        window_s=rates.window_s, req_s_window=win_req, req_s_total=tot_req, tok_s_window=win_tok,
        tok_s_total=tot_tok, avg_completion_tokens_window=win_avg, avg_completion_tokens_total=tot_avg,
        history=rates.history(), in_flight=sum(d.in_flight for d in all_ds),
        effective_concurrency=sum(d.concurrency.limit for d in active),
        configured_concurrency=sum(d.config.concurrency for d in active),
        eta_s=(admissible / win_req) if win_req > 0 and state == RunState.RUNNING else None)
    credits = snap.Credits(
        balance_usd=money.balance_now(), balance_age_s=money.balance_age(),
        spent_usd=money.spent_run, spent_total_usd=money.spent_total, in_flight_usd=money.in_flight,
        projected_total_usd=(money.spent_total + projected_remaining) if cost_per_answer else None,
        max_usd=money.max_usd, floor_usd=money.floor_usd)
    return snap.RunSnapshot(
        run_name=run_name, model=model, state=state, elapsed_s=elapsed_s, seq=seq, datasets=tuple(shots),
        throughput=throughput, errors=ledger.errors.items(), retries=retries,
        providers=ledger.providers.items(), credits=credits, alert=alert, waiting=waiting)
