"""What a run says as it goes: typed events beside the snapshot (core/live/snapshot.py).

Every `EventKind` has one payload class (a frozen dataclass under `Payload`, in core/live/payloads.py
or core/live/stage_payloads.py; `PAYLOADS` holds them all): it declares its kind and its usual level,
carries its figures as fields (prose from elsewhere, a server's error, in a field named for what it
is) and makes its message (`text()`). The engine's parts send
payloads through an `EventSink` (one argument: `ctx.event(Draining(in_flight=n))`); the pipeline's
EventPublisher (core/run/events.py) redacts them, once, and makes each an `Event`: the time, the
payload and the message as it left, which the hub, events.log and the attach stream carry. Views and
the headless printer decide from the payload (its type, its fields), never from the message's words.
Over attach an event travels as JSON, its payload's fields under `data`; `event_from_dict`
(core/live/snapshot.py) rebuilds the payload by its kind, and one it cannot (a newer engine's kind)
comes as `Other`, shown by its message.
"""

from __future__ import annotations

import dataclasses
import time
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
    OTHER = "other"                          # a kind this side does not know (an attach stream from a newer engine)


# -- payloads: the base of the one frozen class per kind (core/live/payloads.py) ----------------------
# Each declares its kind and its usual level, carries its figures as fields and renders its message
# (`text()`). `dataset` names the dataset it is about ("": the run's); `at` overrides the usual level
# where one kind has several (a provider gone bad is a warning, back again is news).

@dataclass(frozen=True, kw_only=True)
class Payload:
    """What an event says: its kind, its level and its figures; `text()` is the message."""
    kind: typing.ClassVar[EventKind]
    usual: typing.ClassVar[Level] = Level.INFO
    dataset: str = ""
    at: Level | None = None

    @property
    def level(self) -> Level:
        return self.at or self.usual

    def text(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Other(Payload):
    """OTHER: a kind this side does not know (an attach stream from a newer engine): its `name`, its
    level and its message as sent; shown, never refused."""
    kind = EventKind.OTHER
    name: str
    line: str

    def text(self) -> str:
        return self.line


class EventSink(typing.Protocol):
    """Where the engine's parts send their events (`Pipeline.emit`)."""

    def __call__(self, payload: Payload, /) -> None: ...


def no_event(payload: Payload, /) -> None:
    """An EventSink that drops every event (a part used outside a run)."""
    return None


@dataclass(frozen=True)
class Event:
    """An event as the hub, events.log and attach carry it: when, and what (`payload`); `message` is
    the payload's text as it left (redacted by core/run/events.py)."""
    ts: float
    payload: Payload
    message: str

    @classmethod
    def of(cls, payload: Payload, ts: float | None = None) -> Event:
        """`payload` as an event now (or at `ts`), its message its text."""
        return cls(time.time() if ts is None else ts, payload, payload.text())

    @property
    def level(self) -> Level:
        return self.payload.level

    @property
    def kind(self) -> EventKind:
        return self.payload.kind

    @property
    def dataset(self) -> str:
        return self.payload.dataset

    def to_dict(self) -> dict[str, typing.Any]:
        return {"ts": self.ts, "level": self.level, "kind": self.kind, "message": self.message,
                "dataset": self.dataset,
                "data": {f.name: getattr(self.payload, f.name) for f in dataclasses.fields(self.payload)}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())
