"""The one immutable picture of a run that every view reads: TUI panels, headless line, attach stream.

The engine builds a `RunSnapshot` several times a second and publishes it with a stream of `Event`s
(core/live/events.py). Views never reach into the engine; they render these. Snapshots and events
travel over the attach socket as JSON (`to_json`, read back by `snapshot_from_dict` and
`event_from_dict` here), so every field is plain data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import time
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from draftgen.core.live.events import Event, EventKind, Level, Other
from draftgen.core.live.payloads import PAYLOADS


class RunState(StrEnum):
    """The run's state, shown in the header (the values travel in snapshots as they are)."""
    IDLE = "IDLE"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    DRAINING = "DRAINING"
    DONE = "DONE"          # ended with every prompt answered, failed or skipped
    STOPPED = "STOPPED"    # ended by stop now (or a dataset's routing) with prompts not asked
    DRAINED = "DRAINED"    # ended by a drain with prompts not asked
    WAITING = "WAITING"    # ended while an account condition (402) held admission
    LIMITED = "LIMITED"    # ended with prompts skipped by max_usd (they stay eligible)


class DatasetStatus(StrEnum):
    """A dataset's status in the datasets panel."""
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    BUDGET = "budget"      # a budget ran out; the rest is skipped
    STOPPED = "stopped"
    ERROR = "error"


class StageState(StrEnum):
    """The state of a stage of the run (smoke, generation, tokens, merge, extract)."""
    IDLE = "idle"          # pending: not started (yet)
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"    # stopped before its end (a quit): its counts say how far it got
    FAILED = "failed"
    SKIPPED = "skipped"    # never started: a stage before it stopped or failed


class Stage(StrEnum):
    """Every stage of a run, in the order a run goes through them (values travel in snapshots)."""
    SMOKE = "smoke"
    GENERATION = "generation"
    TOKENS = "tokens"
    MERGE = "merge"
    EXTRACT = "extract"


@dataclass(frozen=True)
class StageWords:
    """How the views name a stage: the snapshot's side of the stage registry (core/run/registry.py,
    whose behaviour this layer cannot import), read by attached viewers as well."""
    name: Stage
    running: str    # the header's word while it runs and generation does not
    what: str       # a sentence's name for it ("the smoke test did not finish")
    finish: str     # the command that runs it again or finishes it ({config}: the config's path)


# One line per stage, in run order: the registry's order (tests/run/test_registry.py checks it).
STAGE_WORDS = (
    StageWords(Stage.SMOKE, "SMOKE TEST", "the smoke test", "draftgen run {config}"),
    StageWords(Stage.GENERATION, "", "the run", "draftgen run {config}"),
    StageWords(Stage.TOKENS, "TOKENS", "tokens", "draftgen tokens {config}"),
    StageWords(Stage.MERGE, "MERGING", "merge", "draftgen merge {config}"),
    StageWords(Stage.EXTRACT, "EXTRACTING", "extract", "draftgen extract {config}"),
)
STAGE_NAMES = tuple(w.name for w in STAGE_WORDS)
# The header's word for a run whose generation has ended while a later stage still runs.
STAGE_RUNNING_LABEL: dict[str, str] = {w.name: w.running for w in STAGE_WORDS if w.running}
_GENERATION = {"IDLE": StageState.IDLE, "RUNNING": StageState.RUNNING, "PAUSED": StageState.RUNNING,
               "DRAINING": StageState.RUNNING, "DONE": StageState.DONE, "LIMITED": StageState.DONE}


@dataclass(frozen=True)
class DatasetSnapshot:
    name: str
    status: DatasetStatus = DatasetStatus.PENDING
    total: int = 0              # usable prompts (rejected lines excluded)
    done: int = 0               # answered, on disk (this run and earlier ones)
    failed: int = 0             # failed for good, on disk
    skipped: int = 0            # not admitted because a budget ran out; eligible for a later run
    rejected: int = 0           # input lines that could not be used
    truncated: int = 0          # answered with finish_reason "length" or empty content
    other_model: int = 0        # answered by another model than the one asked (kept, never a sample)
    in_flight: int = 0
    concurrency: int = 0        # configured
    effective_concurrency: int = 0  # after 429 back-off
    tokens_used: int = 0        # completion tokens of answers (reasoning included)
    prompt_tokens: int = 0      # prompt tokens of answers, as billed (usage.prompt_tokens), on disk
    reasoning_tokens: int = 0   # of tokens_used, the reasoning's (usage's reasoning_tokens; 0 where not said)
    tokens_in_flight: int = 0   # expected tokens of requests in flight (counted against the budget)
    token_budget: int | None = None
    cost_usd: float = 0.0
    projected_cost_usd: float | None = None  # to finish this dataset, from observed cost per answer
    message: str = ""           # why it stopped, when it did
    # turns = "all" (docs/multi-turn.md): total/done/... above count turns; its conversations beside them.
    conversations: int = 0          # usable conversations (0: a single-turn dataset)
    conversations_done: int = 0     # every turn answered
    conversations_ended: int = 0    # ended early (a broken turn, a skip, an edited prompt file)
    turns_by_number: tuple[tuple[int, int], ...] = ()  # (answered, total) of turn 1, 2, ...
    last_conversation: tuple[str, ...] = ()  # the last one finished or ended: its id, then one line a turn
    # Agent lines (OpenAI layout with tools, docs/multi-turn.md): a turn is a step (one assistant message).
    tool_calls: int = 0             # answers that called tools
    diverged: int = 0               # conversations ended by an answer that was not the dataset's next move
    replayed: int = 0               # steps sent with a replayed tool result (tool_results = "replay")
    tool_calls_by_number: tuple[int, ...] = ()  # answers that called tools at step 1, 2, ... (as turns_by_number)
    diverged_by_number: tuple[int, ...] = ()    # conversations that diverged at step 1, 2, ...


@dataclass(frozen=True)
class Throughput:
    window_s: float = 30.0
    req_s_window: float = 0.0
    req_s_total: float = 0.0
    tok_s_window: float = 0.0          # completion tokens/s
    tok_s_total: float = 0.0
    avg_completion_tokens_window: float = 0.0
    avg_completion_tokens_total: float = 0.0
    history: tuple[float, ...] = ()    # req/s per second, oldest first (sparkline)
    in_flight: int = 0
    effective_concurrency: int = 0
    configured_concurrency: int = 0
    eta_s: float | None = None


@dataclass(frozen=True)
class Credits:
    balance_usd: float | None = None    # last fetched balance minus spend since
    balance_age_s: float | None = None  # seconds since it was fetched
    spent_usd: float = 0.0              # this run (this process), known costs
    spent_total_usd: float = 0.0        # the spend ledger over all runs: known costs + pending at worst case
    in_flight_usd: float = 0.0          # reserved: the worst-case cost of the requests in flight
    projected_total_usd: float | None = None  # spent + the estimate to finish every dataset, <= max_usd
    max_usd: float | None = None
    floor_usd: float = 0.0
    pending_usd: float = 0.0            # of spent_total_usd: abandoned attempts not priced yet (worst case)
    balance_source: str = "unknown"     # "credits", "key limit" or "unknown"
    ceiling_limited: bool = False       # the reservations under max_usd, not the slots, bound concurrency
    projected_low_usd: float | None = None
    projected_high_usd: float | None = None
    projected_capped: bool = False      # max_usd stops the run before every dataset is done


@dataclass(frozen=True)
class GpuStat:
    index: int
    name: str
    util_pct: float
    mem_used_mb: float
    mem_total_mb: float
    power_w: float | None
    temp_c: float | None
    physical: int | None = None   # NVML's index when CUDA_VISIBLE_DEVICES renumbers (index is cuda:N)
    error: str | None = None      # this device's NVML query failed: the other fields are empty


@dataclass(frozen=True)
class StageProgress:
    """Progress of a one-shot stage (smoke, tokens, merge, extract)."""
    name: str
    state: StageState = StageState.IDLE
    done: int = 0
    total: int = 0
    rate: float = 0.0                   # items (or tokens) per second
    rate_unit: str = "/s"
    eta_s: float | None = None
    detail: tuple[tuple[str, str], ...] = ()  # ordered label/value pairs for the panel
    checks: tuple[tuple[str, bool, str], ...] = ()  # smoke checklist rows: (check, passed, reason)
    message: str = ""


@dataclass(frozen=True)
class TurnAgreement:
    """The prompt check of one turn number of multi-turn answers (core/tokens/fidelity.py TurnFigures)."""
    turn: int
    answers: int
    exact: float | None             # share whose rendered prompt (history included) equals usage.prompt_tokens
    mean_diff: float | None         # mean of rendered - usage.prompt_tokens


@dataclass(frozen=True)
class ProviderFidelity:
    """One provider's token-count agreement so far (core/tokens/fidelity.py), for the providers panel."""
    name: str
    answers: int
    answer_exact: float | None      # share of answers whose token count equals the billed one
    prompt_exact: float | None      # share whose rendered prompt equals usage.prompt_tokens
    flagged: str = ""               # why its counts depart from the other providers' ("" when they do not)
    prompt_by_turn: tuple[TurnAgreement, ...] = ()  # the prompt check per turn number (multi-turn answers)


@dataclass(frozen=True)
class ErrorRecord:
    """One failed attempt, kept in the engine's bounded rings for the drill-down views."""
    ts: float                 # wall clock
    kind: str                 # as tallied in RunSnapshot.errors
    dataset: str
    prompt_id: str
    attempt: int
    message: str              # redacted, cut to 300 characters (core/live/recent.py)
    status: int | None = None
    provider: str = ""        # "" when the failure names none (most transport errors)
    final: bool = False       # the prompt failed for good with it (else it was retried or kept)


@dataclass(frozen=True)
class ProviderStat:
    """Per provider (as in RunSnapshot.providers): answers, attributed errors and latency."""
    name: str
    answers: int = 0
    errors: int = 0
    latency_mean_s: float = 0.0
    latency_p90_s: float = 0.0
    completion_tokens: int = 0
    server: bool = False  # a server of a fleet ([api] base_url a list), named by its URL without credentials
    out: str = ""         # a fleet's server taken out: why (it is probed and comes back at its first answer)
    limit: int = 0        # a fleet's server: its own adaptive limit now (cut by its 429 storms); 0 otherwise
    limit_configured: int = 0  # a fleet's server: the limit it grows back to (the run's concurrency shared evenly)


# One history point: wall clock at its start, then the rates over it.
TIMELINE_FIELDS = ("ts", "req_s", "tok_s", "usd_min", "error_pct", "in_flight")


@dataclass(frozen=True)
class Timeline:
    """The whole run's history, bounded: at most `capacity` points, each `interval_s` long (pairs are
    merged when it fills, so the resolution halves instead of the start being forgotten)."""
    interval_s: float = 5.0
    points: tuple[tuple[float, ...], ...] = ()   # TIMELINE_FIELDS per point, oldest first
    runs: tuple[float, ...] = ()                 # wall-clock start of each run found in the run directory

    def series(self, name: str) -> tuple[float, ...]:
        i = TIMELINE_FIELDS.index(name)
        return tuple(p[i] for p in self.points)


@dataclass(frozen=True)
class RunSnapshot:
    run_name: str
    model: str
    state: RunState = RunState.IDLE
    elapsed_s: float = 0.0
    seq: int = 0
    taken_at: float = field(default_factory=time.time)
    datasets: tuple[DatasetSnapshot, ...] = ()
    throughput: Throughput = Throughput()
    errors: tuple[tuple[str, int], ...] = ()      # kind -> count, most first
    retries: int = 0
    providers: tuple[tuple[str, int], ...] = ()   # provider (quantization) -> answers
    fidelity: tuple[ProviderFidelity, ...] = ()   # per provider, from the reconstructed answers
    credits: Credits = Credits()
    gpus: tuple[GpuStat, ...] | None = None       # None: no GPU / NVML absent
    stages: tuple[StageProgress, ...] = ()        # smoke, tokens, merge, extract
    alert: str = ""                               # e.g. 402: out of credits, run paused
    waiting: str = ""                             # why no progress is made now (held, unreachable, backing off)
    paused_by: str = ""                           # who paused the run: "by the user", "for the smoke test"; "" else
    attached: bool = False                        # set by the attach viewer, never by the engine
    started_at: float = 0.0                       # wall clock this run (process) started
    first_started_at: float = 0.0                 # wall clock the first run of this directory started
    timeline: Timeline = Timeline()               # history of the rates, whole run (history.jsonl)
    recent_errors: tuple[ErrorRecord, ...] = ()   # newest last; bounded per kind, dataset and provider
    provider_stats: tuple[ProviderStat, ...] = ()
    ended: str = ""                               # why the run ended (final states only), with counts
    held_answers: int = 0                         # paid answers held in memory, not on disk (the disk refused)
    held: str = ""                                # what became of the held answers (written, spooled to, lost)
    generation: StageState | None = None          # the generation stage; None: read from `state`
    # How the run stands as a whole, decided by its one owner (core/run/life.py `RunLife`) when the snapshot
    # is made and read as it is by every view (header, headless lines, summary, attach): none decides again.
    label: str = ""          # the header's word: the state, a later stage's (MERGING), or FAILED/STOPPED after DONE
    finished: bool = False   # generation has ended and no other stage still runs: nothing is left to wait for

    def stage(self, name: str) -> StageProgress | None:
        return next((s for s in self.stages if s.name == name), None)

    def stage_state(self, name: str) -> StageState:
        """The typed state of any stage of STAGE_NAMES (generation's from `state` unless set)."""
        if name == "generation":
            return self.generation or _GENERATION.get(self.state, StageState.STOPPED)
        st = self.stage(name)
        try:
            return StageState.IDLE if st is None else StageState(st.state)
        except ValueError:  # a newer engine's state (attached): counted as running, never as done
            return StageState.RUNNING

    def running_stage(self) -> str | None:
        """The stage running now (the first in run order), None when none is."""
        return next((n for n in STAGE_NAMES if self.stage_state(n) == StageState.RUNNING), None)

    def to_json(self) -> bytes:
        return orjson.dumps(self)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(tp: Any, value: Any) -> Any:
    """Rebuild a value of the annotated type `tp` from its JSON form (lists back to tuples, dicts
    back to dataclasses, strings back to enums), so a new field needs no line here."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(inner[0], value) if len(inner) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from(tp, value)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:  # a newer engine's state: shown as it is rather than refused
            return value
    return value


def _from(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a snapshot dataclass from its JSON dict (the attach viewer's side); fields it does not
    know are ignored and fields it lacks keep their defaults."""
    hints = _hints(cls)
    return cls(**{f.name: _decode(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


def snapshot_from_dict(data: dict[str, Any]) -> RunSnapshot:
    """A snapshot from its JSON dict (the attach viewer's side). An older engine's lacks `label` and
    `finished`: its state is shown as the label (what its header showed unless a later stage ran), and it
    does not read as finished (a viewer closes when asked, never waiting on it)."""
    snapshot: RunSnapshot = _from(RunSnapshot, data)
    if "label" not in data:
        snapshot = dataclasses.replace(snapshot, label=str(snapshot.state))
    return snapshot


def event_from_dict(data: dict[str, typing.Any]) -> Event:
    """An event from its JSON dict (the attach viewer's side): the payload rebuilt as its kind's class
    from its fields (core/live/payloads.py); a kind this side does not know, or fields it cannot take
    (a newer or older engine), come as `Other` with the level and message as sent."""
    message = str(data.get("message", ""))
    ts = float(data.get("ts", 0.0))
    fields = data.get("data")
    with contextlib.suppress(ValueError, TypeError):
        payload_cls = PAYLOADS[EventKind(str(data.get("kind")))]
        if isinstance(fields, dict):
            names = {f.name for f in dataclasses.fields(payload_cls)}
            payload = payload_cls(**{k: v for k, v in fields.items() if k in names})
            if payload.at is not None:
                payload = dataclasses.replace(payload, at=Level(payload.at))
            return Event(ts, payload, message)
    try:
        level = Level(str(data.get("level")))
    except ValueError:
        level = Level.INFO
    return Event(ts, Other(name=str(data.get("kind", "")), line=message, at=level,
                         dataset=str(data.get("dataset", "") or "")), message)
