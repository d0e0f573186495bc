"""The whole-run projection: what finishing every dataset of the config will cost and take.

One function for the smoke test and the running engine, so the two agree. For each dataset, the
tokens of an answer come from the best figure there is: its own answers once there are enough
(observed), else the answers of the other datasets (capped at its max_tokens), else the prior of
half its max_tokens; the smoke answer only lowers the low end. The cost of a token comes from the
same answers (their cost over their tokens), else the smoke answer, else the worst-case prices.
Each dataset gets a range: low (the shortest plausible answers) to high (every answer at max_tokens
and the worst-case price), both capped by its token budget; the run's total is capped by max_usd.
Time: the tokens left over the observed token rate, scaled by each dataset's concurrency, else the
smoke request's own pace times the concurrency; datasets add up unless they run in parallel.

A `turns = "all"` dataset counts turns (one request each), and turn k's prompt carries the target's
k-1 earlier answers: `history_answers` (their mean per request, `history_per_turn`) adds that many
answers' tokens at the prompt price to each request's cost, expected and worst case alike, so a
K-turn conversation costs about K² answers of prompt tokens beside its K answers. Observed costs
already hold the histories of the turns answered so far; `growth` scales them by how much longer
the histories of the turns left are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from draftgen.core.generate.api.prices import Prices
from draftgen.core.units import usd

MIN_SAMPLES = 20  # answers of a dataset before its own mean is trusted (short answers land first)


@dataclass(frozen=True)
class DatasetFigures:
    """What is known about one dataset, from the engine or from disk and the smoke test."""
    name: str
    remaining: int                    # prompts not yet answered, failed or skipped (or left in flight)
    max_tokens: int
    concurrency: int
    token_budget_left: int | None     # None: no token budget
    answers: int = 0                  # answers observed (all runs)
    completion_tokens: int = 0        # their completion tokens
    cost_usd: float = 0.0             # their cost
    prices: Prices | None = None      # worst case
    prompt_tokens: float = 0.0        # mean prompt tokens of its requests (a bound), for the price prior
    history_answers: float = 0.0      # turns = "all": earlier answers a remaining request's prompt carries, mean
    # turns = "all": how much more a request left costs than one answered so far, its history being
    # longer (DatasetRun's ConversationCounts.growth), applied to the observed cost; 1.0 for single turns.
    growth: float = 1.0


@dataclass(frozen=True)
class SmokeFigures:
    """The smoke request's answer: a pace and a price, not a length (its prompt is tiny)."""
    completion_tokens: int
    cost_usd: float
    latency_s: float


@dataclass(frozen=True)
class DatasetForecast:
    name: str
    answers_left: int
    tokens_per_answer: float
    cost_usd: float                   # to finish it
    low_usd: float
    high_usd: float
    time_s: float | None
    basis: str                        # "observed", "other datasets", "max_tokens prior"


@dataclass(frozen=True)
class RunForecast:
    datasets: tuple[DatasetForecast, ...]
    spent_usd: float
    left_usd: float
    low_usd: float
    high_usd: float
    max_usd: float | None
    time_s: float | None

    @property
    def total_usd(self) -> float:
        """Spent plus the estimate to finish, never past the ceiling (the run stops there) unless the
        spend already is (a provider billed past its reservations)."""
        total = self.spent_usd + self.left_usd
        return min(total, max(self.max_usd, self.spent_usd)) if self.max_usd is not None else total

    @property
    def range_usd(self) -> tuple[float, float]:
        low, high = self.spent_usd + self.low_usd, self.spent_usd + self.high_usd
        if self.max_usd is not None:
            cap = max(self.max_usd, self.spent_usd)
            low, high = min(low, cap), min(high, cap)
        return low, high

    @property
    def capped(self) -> bool:
        """max_usd stops the run before every dataset is done (at the estimate)."""
        return self.max_usd is not None and self.spent_usd + self.left_usd > self.max_usd

    def describe(self) -> str:
        low, high = self.range_usd
        text = f"{usd(self.total_usd)} (range {usd(low)}-{usd(high)})"
        if self.capped:
            text += f", stopped by max_usd {usd(self.max_usd)} before every dataset is done"
        return text


def forecast(figures: Sequence[DatasetFigures], *, spent_usd: float, max_usd: float | None,
             tokens_per_s: float = 0.0, running_concurrency: int = 0, smoke: SmokeFigures | None = None,
             parallel: bool = False) -> RunForecast:
    """Project every dataset of the run; `tokens_per_s` is the observed completion-token rate at
    `running_concurrency` requests (0: not running yet)."""
    seen = [f for f in figures if f.answers >= MIN_SAMPLES and f.completion_tokens > 0]
    seen_tokens = sum(f.completion_tokens for f in seen)
    seen_answers = sum(f.answers for f in seen)
    mean_seen = seen_tokens / seen_answers if seen_answers else 0.0
    per_token_seen = sum(f.cost_usd for f in seen) / seen_tokens if seen_tokens else 0.0
    per_token_smoke = smoke.cost_usd / smoke.completion_tokens if smoke and smoke.completion_tokens else 0.0
    pace_smoke = smoke.completion_tokens / smoke.latency_s if smoke and smoke.latency_s > 0 else 0.0
    out = []
    for f in figures:
        # What one answer of t tokens costs again as history: t x the earlier answers a request carries.
        history = f.history_answers * (f.prices.prompt if f.prices else 0.0)
        worst_answer = f.prices.worst_case(round(f.prompt_tokens + f.history_answers * f.max_tokens),
                                           f.max_tokens) if f.prices else 0.0
        if f in seen:
            tokens = f.completion_tokens / f.answers
            per_answer = f.cost_usd / f.answers * f.growth  # a turn left carries a longer history than those seen
            low_tokens, basis = tokens, "observed"
            per_token = f.cost_usd / f.completion_tokens
        else:
            tokens = min(mean_seen, f.max_tokens) if mean_seen else f.max_tokens / 2
            basis = "other datasets" if mean_seen else "max_tokens prior"
            per_token = per_token_seen or per_token_smoke or (
                (f.prices.completion + f.prices.prompt * f.prompt_tokens / max(1.0, tokens)) if f.prices else 0.0)
            per_answer = tokens * (per_token + history)
            low_tokens = min(tokens, smoke.completion_tokens) if smoke and smoke.completion_tokens else tokens / 4
        high_answer = max(worst_answer, f.max_tokens * (per_token + history), per_answer)
        answers = _answers_within(f, tokens)
        low_answers = _answers_within(f, max(1.0, low_tokens))
        high_answers = _answers_within(f, f.max_tokens)
        time_s = None
        tok_left = answers * tokens
        if tokens_per_s > 0 and running_concurrency > 0:
            time_s = tok_left / (tokens_per_s * f.concurrency / running_concurrency)
        elif pace_smoke > 0:
            time_s = tok_left / (pace_smoke * f.concurrency)
        out.append(DatasetForecast(
            name=f.name, answers_left=answers, tokens_per_answer=round(tokens, 1), cost_usd=answers * per_answer,
            low_usd=low_answers * low_tokens * (per_token + history) if basis != "observed" else answers * per_answer,
            high_usd=max(high_answers * high_answer, answers * per_answer), time_s=time_s, basis=basis))
    times = [d.time_s for d in out if d.answers_left]
    known = [t for t in times if t is not None]
    total_time = None if len(known) < len(times) else (max(known, default=0.0) if parallel else sum(known))
    return RunForecast(datasets=tuple(out), spent_usd=spent_usd, left_usd=sum(d.cost_usd for d in out),
                       low_usd=sum(d.low_usd for d in out), high_usd=sum(d.high_usd for d in out),
                       max_usd=max_usd, time_s=total_time)


def _answers_within(f: DatasetFigures, tokens_per_answer: float) -> int:
    """Answers still to come: the prompts left, or fewer when the token budget runs out first."""
    if f.token_budget_left is None:
        return f.remaining
    return min(f.remaining, int(f.token_budget_left / max(1.0, tokens_per_answer)))


def history_per_turn(turns: Iterable[int]) -> float:
    """The mean earlier answers a request of a `turns = "all"` dataset carries, over conversations of these
    user-turn counts: a K-turn conversation asks K requests carrying 0, 1, ..., K-1 answers (K(K-1)/2)."""
    requests = histories = 0
    for k in turns:
        requests += k
        histories += k * (k - 1) // 2
    return histories / requests if requests else 0.0
