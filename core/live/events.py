"""What a run says as it goes: typed events beside the snapshot (core/live/snapshot.py), each with a
`Level`, an `EventKind` and the message the log and the views show; the kinds that carry figures
carry them as a payload (`Event.data`). The engine's parts send them through an `EventSink`; they
travel over the attach socket as JSON (`event_from_dict` in core/live/snapshot.py reads them back).
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from dataclasses import dataclass
from enum import StrEnum

import orjson


class Level(StrEnum):
    """How much an event matters: the log's level filter and the headless printer read it."""
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


class EventKind(StrEnum):
    """What an event is about (the values travel in the attach stream as they are)."""
    ACCOUNT = "account"                      # an account condition stopped admission, or cleared
    ALERT = "alert"                          # the run's alert bar changed (a full disk, ...)
    ANSWERS_LOST = "answers_lost"            # the spend ledger has answers the responses file lacks
    ATTACH = "attach"                        # the attach server or viewer (connected, lost, refused)
    BAD_BILL = "bad_bill"                    # an answer's cost or token counts not believed (billing.py)
    BUDGET = "budget"                        # a token or money budget skipped prompts
    CREDITS = "credits"                      # the balance, or why it could not be read
    CONCURRENCY = "concurrency"              # a 429 storm began (the limit cut) or ended, the limit back
    CONVERSATION = "conversation"            # a conversation ended early, or its prompt file was edited
    CUT_ANSWERS = "cut_answers"              # most of a dataset's answers this run are cut at max_tokens
    DATASET_DONE = "dataset_done"
    DATASET_START = "dataset_start"
    DATASET_STOPPED = "dataset_stopped"      # stopped by its routing or settings
    DRAINING = "draining"
    DUPLICATE = "duplicate"                  # a prompt skipped: already answered in another dataset
    EXTRACT_DONE = "extract_done"
    HELD_WAIT = "held_wait"                  # paid answers held in memory, waiting for the disk
    HELD_WRITTEN = "held_written"
    HISTORY = "history"                      # history.jsonl could not be written
    MERGE_DONE = "merge_done"
    OVER_RESERVATION = "over_reservation"    # an attempt billed past its reservation (a provider's doing)
    PAST_CAP = "past_cap"                    # a provider ran an answer past max_tokens: cut, not kept
    METRICS = "metrics"                      # the /metrics server ([monitor] metrics) and its address
    PAUSED = "paused"
    PENDING = "pending"                      # attempts of earlier runs not priced yet
    PRICES = "prices"
    QUIT_DIALOG = "quit_dialog"              # the run waits for the quit dialog's answer before it starts
    PROVIDER = "provider"                    # a provider gone bad (most of its last attempts failed), or back
    PROVIDER_FLAGGED = "provider_flagged"    # a provider's token counts depart from the others'
    REACHABLE = "reachable"
    REJECTED = "rejected"                    # prompt lines rejected when a dataset opened
    REPAIRED = "repaired"                    # a half-written last line cut
    REQUEST_ERROR = "request_error"          # a request ended on an error of the engine's own (a bug), with its cause
    REQUEST_KEYS = "request_keys"
    RESUMED = "resumed"
    RUN_DONE = "run_done"
    RUN_FAILED = "run_failed"
    SERVER_IDS = "server_ids"                # the self-hosted server's token ids: how asked, or missing
    SIGNAL = "signal"
    SMOKE = "smoke"                          # the smoke test runs first
    SMOKE_DONE = "smoke_done"
    SPOOL = "spool"                          # spooled records imported (or not)
    SPOOLED = "spooled"
    STOPPING = "stopping"
    TOKENS_DONE = "tokens_done"
    TOKENS_FAILED = "tokens_failed"
    TOKENS_WORKER_DIED = "tokens_worker_died"
    UNLEDGERED = "unledgered"                # answers without a spend-ledger line
    UNREACHABLE = "unreachable"
    UNSAVED = "unsaved"                      # records the disk never took


# -- typed payloads: the figures an event carries beside its message (one class per kind) -----------
# The message stays what the log and the views show; a consumer that needs a figure reads `Event.data`
# (the payload of its kind, or None: an event without figures, or from an engine that sends none).

@dataclass(frozen=True)
class DatasetDone:
    """DATASET_DONE: how the dataset ended and its figures."""
    status: str
    answered: int
    total: int
    failed: int
    skipped: int
    cost_usd: float


@dataclass(frozen=True)
class OverReservation:
    """OVER_RESERVATION: an attempt billed past the reservation taken for it."""
    provider: str
    reserved_usd: float
    billed_usd: float


@dataclass(frozen=True)
class ProviderPastCap:
    """PAST_CAP: a provider ran an answer past max_tokens (cut, booked at what it billed)."""
    provider: str


EventData = DatasetDone | OverReservation | ProviderPastCap
# The payload class of each kind that carries one (what the attach side decodes `data` as).
EVENT_DATA: dict[EventKind, type] = {EventKind.DATASET_DONE: DatasetDone, EventKind.OVER_RESERVATION: OverReservation,
                                     EventKind.PAST_CAP: ProviderPastCap}


class EventSink(typing.Protocol):
    """Where the engine's parts send their events (`Pipeline.emit`); `dataset` names the one it is about,
    `data` carries the figures of a kind listed in EVENT_DATA."""

    def __call__(self, level: Level, kind: EventKind, message: str, dataset: str = "",
                 data: EventData | None = None) -> None: ...


def _no_event(level: Level, kind: EventKind, message: str, dataset: str = "", data: EventData | None = None) -> None:
    return None


def event_sink(fn: typing.Callable[..., None] | None) -> EventSink:
    """`fn` as an EventSink. Callbacks of the older shapes still work: `(level, kind, message, dataset=)`
    is called without the data, `(level, kind, message)` without the dataset either."""
    if fn is None:
        return _no_event
    try:
        sig = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): taken as it is
        return typing.cast(EventSink, fn)
    try:
        sig.bind("info", "kind", "message", dataset="", data=None)
        return typing.cast(EventSink, fn)
    except TypeError:
        pass
    older = fn
    try:
        sig.bind("info", "kind", "message", dataset="")
    except TypeError:
        return lambda level, kind, message, dataset="", data=None: older(level, kind, message)
    return lambda level, kind, message, dataset="", data=None: older(level, kind, message, dataset=dataset)


@dataclass(frozen=True)
class Event:
    ts: float
    level: Level
    kind: EventKind
    message: str
    dataset: str = ""   # the dataset it is about ("": the run's); the message still names it for the log
    data: EventData | None = None  # the figures of a kind in EVENT_DATA (the message says them too)

    def __post_init__(self) -> None:
        # Callers may pass the plain strings (older call sites, attach streams): stored as the enums.
        for name, kind in (("level", Level), ("kind", EventKind)):
            value = getattr(self, name)
            if type(value) is not kind:
                with contextlib.suppress(ValueError):  # a newer engine's value: shown as it is, not refused
                    object.__setattr__(self, name, kind(value))

    def to_json(self) -> bytes:
        return orjson.dumps(self)
