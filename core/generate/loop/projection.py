"""The run's picture, made in one place (`Projector`): counts as they are, and what finishing will take.

What is left of a dataset is its usable prompts not yet done, failed or skipped, capped by what
its token budget still allows at the average answer length (a turns = "all" dataset: its turns, each
turn left priced up by how much longer its history is than those answered, ConversationCounts.growth);
projected cost and the ETA cover every dataset of the config, those not started included, by
forecast.py (the function smoke uses too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.loop.run_state import LIVE, ControlView
from draftgen.core.generate.money.budget import MoneyBudget
from draftgen.core.generate.money.forecast import DatasetFigures, RunForecast, SmokeFigures, forecast
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.snapshot import DatasetStatus, RunState, StageState, Timeline
from draftgen.core.safe_text import visible


def remaining(ds: DatasetRun) -> int:
    """Answers this dataset may still ask for, this run or the next: a dataset the run's drain or stop
    left STOPPED keeps its prompts not asked yet (the next run resumes it), so its projection stays the
    whole dataset's; one that is DONE, ended by a budget or stopped by its own settings has only what
    is in flight left."""
    left = max(0, ds.total - ds.done - ds.failed - ds.skipped)
    if ds.token_budget.limit is not None and ds.token_budget.answers:
        by_budget = (ds.token_budget.remaining() or 0) / max(1.0, ds.token_budget.used / ds.token_budget.answers)
        left = min(left, int(by_budget) + ds.in_flight)
    if ds.status in (DatasetStatus.BUDGET, DatasetStatus.DONE) or ds.stopped:
        left = ds.in_flight
    return left


# An ETA from fewer answers, or from less than one rate window, swings by hours (the first answers
# land after the longest latency): "—" until both are there.
ETA_MIN_ANSWERS = 20


def stable_eta(time_s: float | None, *, answers: int, elapsed_s: float, window_s: float,
               work_left: bool) -> float | None:
    """The ETA to show, or None ("—"): not before ETA_MIN_ANSWERS answers and one rate window of this
    run, and never 0 while prompts are left."""
    if time_s is None or answers < ETA_MIN_ANSWERS or elapsed_s < window_s:
        return None
    if work_left and time_s < 1.0:
        return None
    return time_s


def _conversations(ds: DatasetRun) -> dict[str, Any]:
    """A turns = "all" dataset's conversation fields of its snapshot row (none for a single-turn one)."""
    if ds.config.turns != "all":
        return {}
    c = ds.conversations
    return {"conversations": c.total, "conversations_done": c.done, "conversations_ended": c.ended,
            "turns_by_number": tuple((c.by_turn_done[k], c.by_turn_total[k]) for k in sorted(c.by_turn_total)),
            "tool_calls": c.tool_calls, "diverged": c.diverged, "replayed": c.replayed,
            "tool_calls_by_number": tuple(c.by_turn_calls[k] for k in sorted(c.by_turn_total)),
            "diverged_by_number": tuple(c.by_turn_diverged[k] for k in sorted(c.by_turn_total)),
            # its id is the prompt file's: shown with its control characters escaped
            "last_conversation": tuple(visible(line) for line in c.last)}


def figures(ds: DatasetRun, spend: SpendLedger, prices: Prices | None) -> DatasetFigures:
    return DatasetFigures(
        name=ds.config.name, remaining=remaining(ds), max_tokens=ds.config.max_tokens,
        concurrency=ds.config.concurrency, token_budget_left=ds.token_budget.remaining(),
        answers=ds.token_budget.answers,
        completion_tokens=ds.token_budget.used, cost_usd=spend.by_dataset.get(ds.config.name, ds.cost), prices=prices,
        **({"growth": ds.conversations.growth(ds.left, ds.done),
            "history_answers": ds.conversations.history_answers(ds.left)} if ds.config.turns == "all" else {}))


@dataclass(frozen=True)
class Beside:
    """What the run's other owners add to the engine's picture, as the pipeline (core/run/pipeline.py)
    reads them for a snapshot; the defaults are an engine run alone (its tests, the benchmarks)."""
    generation: StageState | None = None   # the generation stage (None: read from the run's state)
    stages: tuple[snap.StageProgress, ...] = ()
    # How the run stands, decided by its one owner (core/run/life.py RunLife). None: an engine run alone,
    # which is generation only: its state is its label, and it is finished once that state is final.
    label: str | None = None
    finished: bool | None = None
    gpus: tuple[snap.GpuStat, ...] | None = None
    fidelity: tuple[snap.ProviderFidelity, ...] = ()
    timeline: Timeline = Timeline()
    started_at: float = 0.0
    first_started_at: float = 0.0
    smoke_spent: tuple[float, float] | None = None  # (before, after) on spend.jsonl: the run never opened its ledger


ALONE = Beside()  # an engine run alone: nothing beside it


@dataclass(frozen=True)
class EngineNow:
    """The engine's figures that change from one snapshot to the next (the rest it owns for good)."""
    control: ControlView
    waiting: str
    elapsed_s: float
    retries: int
    prices: Mapping[str, Prices | None]
    smoke: SmokeFigures | None


class Projector:
    """The one place a run's snapshot is made: from the engine's owners (its datasets, record book,
    money, recent errors), the run's state and end (`ControlView`) and what the pipeline adds beside
    them (`Beside`), each field set once."""

    def __init__(self, *, run_name: str, model: str, parallel: bool, datasets: Iterable[DatasetRun],
                 book: RecordBook, money: MoneyBudget, recent: RecentErrors, provider_stats: ProviderStats) -> None:
        self._run_name = run_name
        self._model = model
        self._parallel = parallel
        self._datasets = list(datasets)
        self._book = book
        self._money = money
        self._recent = recent
        self._provider_stats = provider_stats
        self._seq = 0

    def snapshot(self, now: EngineNow, beside: Beside) -> snap.RunSnapshot:
        self._seq += 1
        book, money, all_ds, c = self._book, self._money, self._datasets, now.control
        rates, spend = book.rates, money.spend
        win_tok = rates.window()[1]
        active = [d for d in all_ds if d.status == DatasetStatus.RUNNING] or all_ds
        running = c.state == RunState.RUNNING
        plan = forecast([figures(d, spend, now.prices.get(d.config.name)) for d in all_ds],
                        spent_usd=spend.spent_usd, max_usd=money.max_usd, tokens_per_s=win_tok if running else 0.0,
                        running_concurrency=sum(d.concurrency.limit for d in active), smoke=now.smoke,
                        parallel=self._parallel)
        return snap.RunSnapshot(
            run_name=self._run_name, model=self._model, state=c.state, elapsed_s=now.elapsed_s, seq=self._seq,
            datasets=_datasets(all_ds, plan, spend, paused=c.state == RunState.PAUSED),
            throughput=_throughput(book, all_ds, active, plan, elapsed_s=now.elapsed_s, running=running),
            errors=book.errors.items(), retries=now.retries, providers=self._provider_stats.answer_counts(),
            fidelity=beside.fidelity, credits=_credits(money, plan, running=running, smoke_spent=beside.smoke_spent),
            gpus=beside.gpus, stages=beside.stages, alert=c.alert, waiting=now.waiting,
            paused_by=c.paused_by.value if c.paused_by is not None else "",
            started_at=beside.started_at, first_started_at=beside.first_started_at, timeline=beside.timeline,
            recent_errors=self._recent.records(), provider_stats=self._provider_stats.stats(), ended=c.ended,
            held_answers=book.held_answers, held=c.held_outcome.line(), generation=beside.generation,
            label=str(c.state) if beside.label is None else beside.label,
            finished=c.state not in LIVE if beside.finished is None else beside.finished)


def _datasets(all_ds: list[DatasetRun], plan: RunForecast, spend: SpendLedger, *,
              paused: bool) -> tuple[snap.DatasetSnapshot, ...]:
    shots = []
    for ds, fc in zip(all_ds, plan.datasets):
        cost = spend.by_dataset.get(ds.config.name, ds.cost)
        shots.append(snap.DatasetSnapshot(
            name=ds.config.name,
            status=DatasetStatus.PAUSED if paused and ds.status == DatasetStatus.RUNNING else ds.status,
            total=ds.total, done=ds.done, failed=ds.failed, skipped=ds.skipped, rejected=ds.rejected,
            truncated=ds.truncated, other_model=ds.other_model, in_flight=ds.in_flight,
            concurrency=ds.config.concurrency,
            effective_concurrency=ds.concurrency.limit, tokens_used=ds.token_budget.used,
            prompt_tokens=ds.usage_tokens[0], reasoning_tokens=ds.usage_tokens[1],
            tokens_in_flight=ds.token_budget.in_flight, token_budget=ds.token_budget.limit, cost_usd=round(cost, 6),
            projected_cost_usd=round(cost + fc.cost_usd, 4) if fc.cost_usd or cost else None, message=ds.message,
            **_conversations(ds)))
    return tuple(shots)


def _throughput(book: RecordBook, all_ds: list[DatasetRun], active: list[DatasetRun], plan: RunForecast, *,
                elapsed_s: float, running: bool) -> snap.Throughput:
    rates = book.rates
    win_req, win_tok, win_avg = rates.window()
    tot_req, tot_tok, tot_avg = rates.total()
    return snap.Throughput(
        window_s=rates.window_s, req_s_window=win_req, req_s_total=tot_req, tok_s_window=win_tok,
        tok_s_total=tot_tok, avg_completion_tokens_window=win_avg, avg_completion_tokens_total=tot_avg,
        history=rates.history(), in_flight=sum(d.in_flight for d in all_ds),
        effective_concurrency=sum(d.concurrency.limit for d in active),
        configured_concurrency=sum(d.config.concurrency for d in active),
        eta_s=stable_eta(plan.time_s, answers=rates.answers, elapsed_s=elapsed_s, window_s=rates.window_s,
                         work_left=any(f.answers_left for f in plan.datasets)) if running else None)


def _credits(money: MoneyBudget, plan: RunForecast, *, running: bool,
             smoke_spent: tuple[float, float] | None) -> snap.Credits:
    spend = money.spend
    spent_run, spent_total = spend.spent_run, spend.spent_usd
    if smoke_spent is not None:  # the run never opened its ledger: what was spent (the smoke test's) is on file
        before, after = smoke_spent
        spent_run, spent_total = max(0.0, after - before), after
    known = plan.left_usd > 0 or not any(f.answers_left for f in plan.datasets)
    low, high = plan.range_usd
    return snap.Credits(
        balance_usd=money.balance_now(), balance_age_s=money.balance_age(),
        spent_usd=spent_run, spent_total_usd=spent_total, in_flight_usd=spend.reserved_usd,
        projected_total_usd=plan.total_usd if known else None, max_usd=money.max_usd, floor_usd=money.floor_usd,
        pending_usd=spend.pending_usd, balance_source=money.balance_source,
        ceiling_limited=running and money.ceiling_limited(),
        projected_low_usd=low if known else None, projected_high_usd=high if known else None,
        projected_capped=plan.capped)
