"""What a run says as it goes: typed events beside the snapshot (core/live/snapshot.py).

Every `EventKind` has one payload class (a frozen dataclass, `PAYLOADS`): it declares its kind and its
usual level, carries its figures as fields and makes its message (`text()`). The engine's parts send
payloads through an `EventSink` (one argument: `ctx.event(Draining(in_flight=n))`); the pipeline's
EventPublisher (core/run/events.py) redacts them, once, and makes each an `Event`: the time, the
payload and the message as it left, which the hub, events.log and the attach stream carry. Views and
the headless printer decide from the payload (its type, its fields), never from the message's words.
Over attach an event travels as JSON, its payload's fields under `data`; `Event.from_dict` rebuilds
the payload by its kind, and one it cannot (a newer engine's kind) comes as `Other`, shown by its
message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import typing
from dataclasses import dataclass
from enum import StrEnum

import orjson

from draftgen.core.units import usd


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


# -- payloads: one frozen class per kind ------------------------------------------------------------
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
class Said(Payload):
    """A kind whose words are prose from elsewhere (an alert, a stage's outcome, a server's error, a
    signal line): `line` is the message as it was said."""
    line: str

    def text(self) -> str:
        return self.line


class AccountChanged(Said):
    """ACCOUNT: an account condition stopped admission (`line`: the alert), or cleared."""
    kind = EventKind.ACCOUNT
    usual = Level.ERROR


class Alert(Said):
    """ALERT: the run's alert bar changed (`line`: the alert)."""
    kind = EventKind.ALERT
    usual = Level.ERROR


@dataclass(frozen=True, kw_only=True)
class AnswersLost(Payload):
    """ANSWERS_LOST: prompts answered on the spend ledger whose answers the responses file lacks."""
    kind = EventKind.ANSWERS_LOST
    usual = Level.WARN
    lost: int
    responses: str

    def text(self) -> str:
        return (f"{self.dataset}: {self.lost} prompt(s) answered on the spend ledger have no answer in "
                f"{self.responses} (lost in a crash?): their cost stays counted and they are asked again")


class Attach(Said):
    """ATTACH: the attach server or viewer (connected, lost, refused)."""
    kind = EventKind.ATTACH
    usual = Level.WARN


class BadBill(Said):
    """BAD_BILL: an answer's cost or token counts not believed (billing.py)."""
    kind = EventKind.BAD_BILL
    usual = Level.WARN


class Budget(Said):
    """BUDGET: a token or money budget skipped prompts (`line` names the budget)."""
    kind = EventKind.BUDGET
    usual = Level.WARN


class CreditsRead(Said):
    """CREDITS: the balance, or why it could not be read."""
    kind = EventKind.CREDITS
    usual = Level.WARN


class Concurrency(Said):
    """CONCURRENCY: a 429 storm began (the limit cut) or ended, the limit back."""
    kind = EventKind.CONCURRENCY
    usual = Level.WARN


class ConversationEnded(Said):
    """CONVERSATION: a conversation ended early, or its prompt file was edited."""
    kind = EventKind.CONVERSATION


@dataclass(frozen=True, kw_only=True)
class CutAnswers(Payload):
    """CUT_ANSWERS: most of a dataset's answers this run are cut at max_tokens (`cut` of `answered`)."""
    kind = EventKind.CUT_ANSWERS
    usual = Level.WARN
    cut: int
    answered: int

    def text(self) -> str:
        return (f"{self.dataset}: {self.cut} of its {self.answered} answers this run were cut at max_tokens: they "
                "are paid for and kept (marked truncated), but the merge leaves them out; drain (q then d; "
                "headless: Ctrl-C) and raise the dataset's max_tokens before asking more")


@dataclass(frozen=True, kw_only=True)
class DatasetDone(Payload):
    """DATASET_DONE: how the dataset ended and its figures (`conversations`: what its conversations
    did, said after the figures)."""
    kind = EventKind.DATASET_DONE
    status: str
    answered: int
    total: int
    failed: int
    skipped: int
    cost_usd: float
    by_max_usd: int = 0       # of the skipped: the prompts max_usd had no room for
    duplicates: int = 0       # of the skipped: already answered in another dataset
    conversations: str = ""

    def text(self) -> str:
        return (f"{self.dataset}: {self.status}: {self.answered}/{self.total} answered, {self.failed} failed, "
                f"{self.skipped} skipped" + (f" ({self.by_max_usd} by max_usd)" if self.by_max_usd else "")
                + (f" ({self.duplicates} already answered in another dataset)" if self.duplicates else "")
                + f", {usd(self.cost_usd)}{self.conversations}")


@dataclass(frozen=True, kw_only=True)
class DatasetStart(Payload):
    """DATASET_START: a dataset opened: its prompts (or turns) and what earlier runs did of them."""
    kind = EventKind.DATASET_START
    total: int
    units: str
    answered: int
    failed: int
    concurrency: int

    def text(self) -> str:
        return (f"{self.dataset}: {self.total} {self.units}, {self.answered} already answered, {self.failed} "
                f"already failed; concurrency {self.concurrency}")


@dataclass(frozen=True, kw_only=True)
class DatasetStopped(Payload):
    """DATASET_STOPPED: stopped by its routing or settings; `cause`: why, as the dataset says it."""
    kind = EventKind.DATASET_STOPPED
    usual = Level.ERROR
    cause: str

    def text(self) -> str:
        return f"{self.dataset}: {self.cause}"


@dataclass(frozen=True, kw_only=True)
class Draining(Payload):
    """DRAINING: nothing more is admitted; the requests in flight finish."""
    kind = EventKind.DRAINING
    in_flight: int

    def text(self) -> str:
        return f"draining: waiting for {self.in_flight} requests in flight"


@dataclass(frozen=True, kw_only=True)
class Duplicate(Payload):
    """DUPLICATE: a prompt skipped: already answered in another dataset (`other`)."""
    kind = EventKind.DUPLICATE
    usual = Level.WARN
    prompt_id: str
    other: str

    def text(self) -> str:
        return (f"{self.dataset}: prompt {self.prompt_id!r} skipped: the same prompt (normalised text) is already "
                f"answered in {self.other}; every such prompt is skipped and counted ([engine] "
                "skip_cross_dataset_duplicates = false sends them)")


class ExtractDone(Said):
    """EXTRACT_DONE: the extraction's outcome."""
    kind = EventKind.EXTRACT_DONE


@dataclass(frozen=True, kw_only=True)
class HeldWait(Payload):
    """HELD_WAIT: paid answers held in memory, waiting for the disk."""
    kind = EventKind.HELD_WAIT
    usual = Level.WARN
    answers: int
    retry_s: float

    def text(self) -> str:
        return (f"{self.answers} paid answer(s) are held in memory, not on disk: the run waits for the disk, "
                f"retrying every {self.retry_s:g} s (free space; r or SIGUSR1 retries now); quit again (a second "
                "SIGINT) to spool them to a fallback file")


@dataclass(frozen=True, kw_only=True)
class HeldWritten(Payload):
    """HELD_WRITTEN: the disk took the records held in memory."""
    kind = EventKind.HELD_WRITTEN

    def text(self) -> str:
        return "the disk took the held records: every answer is on disk"


class History(Said):
    """HISTORY: history.jsonl could not be written."""
    kind = EventKind.HISTORY
    usual = Level.WARN


class MergeDone(Said):
    """MERGE_DONE: the merge's outcome."""
    kind = EventKind.MERGE_DONE


@dataclass(frozen=True, kw_only=True)
class OverReservation(Payload):
    """OVER_RESERVATION: an attempt billed past the reservation taken for it: at its answer, or later by
    its generation record (`by_record`); `times`: how often this provider did it so far."""
    kind = EventKind.OVER_RESERVATION
    usual = Level.WARN
    provider: str
    prompt_id: str
    reserved_usd: float
    billed_usd: float
    by_record: bool = False
    times: int = 1

    def text(self) -> str:
        if self.by_record:
            return (f"{self.dataset}: provider {self.provider}: prompt {self.prompt_id!r} billed "
                    f"${self.billed_usd:.6f} by its generation record, ${self.billed_usd - self.reserved_usd:.6f} "
                    f"past the ${self.reserved_usd:.6f} it was counted at: booked at what it billed, so max_usd "
                    "counts it")
        return (f"{self.dataset}: provider {self.provider}{_times(self.times)}: prompt {self.prompt_id!r} billed "
                f"${self.billed_usd:.6f}, ${self.billed_usd - self.reserved_usd:.6f} past its reservation of "
                f"${self.reserved_usd:.6f}: booked at what it billed, so max_usd counts it")


@dataclass(frozen=True, kw_only=True)
class ProviderPastCap(Payload):
    """PAST_CAP: a provider ran an answer past max_tokens (cut, booked at what it billed); `cause`: the
    error as the request ended on it."""
    kind = EventKind.PAST_CAP
    usual = Level.WARN
    provider: str
    prompt_id: str
    cause: str
    times: int = 1

    def text(self) -> str:
        return (f"{self.dataset}: provider {self.provider}{_times(self.times)}: prompt {self.prompt_id!r}: "
                f"{self.cause}; booked at what it billed, the prompt is asked again (docs/money.md)")


def _times(n: int) -> str:
    return f" ({n} times so far)" if n > 1 else ""


@dataclass(frozen=True, kw_only=True)
class Metrics(Payload):
    """METRICS: the /metrics server ([monitor] metrics) and its address."""
    kind = EventKind.METRICS
    url: str

    def text(self) -> str:
        return f"metrics: serving {self.url}"


@dataclass(frozen=True, kw_only=True)
class Paused(Payload):
    """PAUSED: the user paused the run (`by`: how)."""
    kind = EventKind.PAUSED
    by: str

    def text(self) -> str:
        return f"paused {self.by} (requests in flight finish and are recorded; none is retried while paused)"


class PendingAttempts(Said):
    """PENDING: attempts of earlier runs not priced yet, or priced now."""
    kind = EventKind.PENDING


class PriceNote(Said):
    """PRICES: a dataset's worst-case prices, or a raise of them."""
    kind = EventKind.PRICES


@dataclass(frozen=True, kw_only=True)
class QuitDialog(Payload):
    """QUIT_DIALOG: the run waits for the quit dialog's answer before it starts."""
    kind = EventKind.QUIT_DIALOG

    def text(self) -> str:
        return "the run starts once the quit dialog is answered"


class Provider(Said):
    """PROVIDER: a provider gone bad (most of its last attempts failed), or back."""
    kind = EventKind.PROVIDER
    usual = Level.WARN


@dataclass(frozen=True, kw_only=True)
class ProviderFlagged(Payload):
    """PROVIDER_FLAGGED: a provider's token counts depart from the others' (`cause`: how, as fidelity says it)."""
    kind = EventKind.PROVIDER_FLAGGED
    usual = Level.WARN
    provider: str
    cause: str

    def text(self) -> str:
        return f"provider {self.provider}: {self.cause} (`draftgen tokens` prints what to change)"


class Reachable(Said):
    """REACHABLE: a server answers again."""
    kind = EventKind.REACHABLE


@dataclass(frozen=True, kw_only=True)
class Rejected(Payload):
    """REJECTED: prompt lines rejected when a dataset opened, and the file that lists them."""
    kind = EventKind.REJECTED
    usual = Level.WARN
    lines: int
    path: str

    def text(self) -> str:
        return f"{self.dataset}: {self.lines} prompt lines rejected (see {self.path})"


@dataclass(frozen=True, kw_only=True)
class Repaired(Payload):
    """REPAIRED: a half-written last line (`cut_bytes`) cut from `path`; `by_crash`: said as a crash's."""
    kind = EventKind.REPAIRED
    usual = Level.WARN
    path: str
    cut_bytes: int
    by_crash: bool = False

    def text(self) -> str:
        return (f"{self.path}: cut a half-written last line ({self.cut_bytes} bytes)"
                + (" left by a crash" if self.by_crash else ""))


@dataclass(frozen=True, kw_only=True)
class RequestError(Payload):
    """REQUEST_ERROR: a request ended on an error of the engine's own (a bug); `cause`: the error."""
    kind = EventKind.REQUEST_ERROR
    usual = Level.ERROR
    prompt_id: str
    cause: str

    def text(self) -> str:
        return (f"{self.dataset}: prompt {self.prompt_id!r} not asked again this run: the engine's own error "
                f"{self.cause}")


class RequestKeys(Said):
    """REQUEST_KEYS: what the requests carry (streamed or not, a key the server kind ignores)."""
    kind = EventKind.REQUEST_KEYS


@dataclass(frozen=True, kw_only=True)
class Resumed(Payload):
    """RESUMED: the run admits again."""
    kind = EventKind.RESUMED

    def text(self) -> str:
        return "resumed"


class RunDone(Said):
    """RUN_DONE: the run ended (or never started), what it spent."""
    kind = EventKind.RUN_DONE


@dataclass(frozen=True, kw_only=True)
class RunFailed(Payload):
    """RUN_FAILED: the run cannot go on; `cause`: the error that stopped it."""
    kind = EventKind.RUN_FAILED
    usual = Level.ERROR
    cause: str

    def text(self) -> str:
        return f"the run cannot go on: {self.cause}"


class ServerIds(Said):
    """SERVER_IDS: the self-hosted server's token ids: how asked, or missing."""
    kind = EventKind.SERVER_IDS
    usual = Level.WARN


class Signal(Said):
    """SIGNAL: a signal came (`line`: what the run does about it)."""
    kind = EventKind.SIGNAL
    usual = Level.WARN


@dataclass(frozen=True, kw_only=True)
class Smoke(Payload):
    """SMOKE: the smoke test runs first; `why`: what asks for it."""
    kind = EventKind.SMOKE
    why: str

    def text(self) -> str:
        return (f"running the smoke test first: {self.why}; no run request is sent before it passes (a quit now "
                "stops it and the run does not start)")


class SmokeDone(Said):
    """SMOKE_DONE: the smoke test's outcome."""
    kind = EventKind.SMOKE_DONE


class SpoolImported(Said):
    """SPOOL: spooled records imported (or not)."""
    kind = EventKind.SPOOL


@dataclass(frozen=True, kw_only=True)
class Spooled(Payload):
    """SPOOLED: answers held in memory (the disk refused them: `cause`) spooled to `path`."""
    kind = EventKind.SPOOLED
    usual = Level.WARN
    answers: int
    cause: str
    path: str
    run_dir: str

    def text(self) -> str:
        return (f"{self.answers} answer(s) held in memory (the disk refused them: {self.cause}) are spooled to "
                f"{self.path}; the next `draftgen run` of {self.run_dir} imports them before it sends anything")


@dataclass(frozen=True, kw_only=True)
class Stopping(Payload):
    """STOPPING: stop now: the requests in flight abandoned."""
    kind = EventKind.STOPPING
    usual = Level.WARN
    abandoned: int

    def text(self) -> str:
        return f"stopping now: {self.abandoned} requests in flight abandoned (they stay eligible for the next run)"


class TokensDone(Said):
    """TOKENS_DONE: token reconstruction's summary."""
    kind = EventKind.TOKENS_DONE


class TokensFailed(Said):
    """TOKENS_FAILED: token reconstruction stopped or failed."""
    kind = EventKind.TOKENS_FAILED
    usual = Level.ERROR


@dataclass(frozen=True, kw_only=True)
class TokensWorkerDied(Payload):
    """TOKENS_WORKER_DIED: a reconstruction worker died; new ones start (`restarts` of at most `limit`)."""
    kind = EventKind.TOKENS_WORKER_DIED
    usual = Level.WARN
    restarts: int
    limit: int
    in_flight: int

    def text(self) -> str:
        return (f"a token reconstruction worker process died (killed, or out of memory): starting new workers "
                f"({self.restarts} of at most {self.limit}); {self.in_flight:,} answers in flight are sent again")


@dataclass(frozen=True, kw_only=True)
class UnledgeredAnswers(Payload):
    """UNLEDGERED: answers without a spend-ledger line, now counted as spent."""
    kind = EventKind.UNLEDGERED
    usual = Level.WARN
    answers: int
    usd: float
    responses: str
    ledger: str

    def text(self) -> str:
        return (f"{self.dataset}: {self.answers} answer(s) in {self.responses} have no line on {self.ledger} (its "
                f"tail lost in a crash?): their {usd(self.usd)} now counts as spent")


class Unreachable(Said):
    """UNREACHABLE: a server cannot be reached (`line`: the cause and what the run does)."""
    kind = EventKind.UNREACHABLE
    usual = Level.WARN


class Unsaved(Said):
    """UNSAVED: records the disk never took."""
    kind = EventKind.UNSAVED
    usual = Level.ERROR


@dataclass(frozen=True, kw_only=True)
class Other(Payload):
    """OTHER: a kind this side does not know (an attach stream from a newer engine): its `name`, its
    level and its message as sent; shown, never refused."""
    kind = EventKind.OTHER
    name: str
    line: str

    def text(self) -> str:
        return self.line


def _kinds() -> dict[EventKind, type[Payload]]:
    found: dict[EventKind, type[Payload]] = {}
    todo: list[type[Payload]] = [Payload]
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if "kind" in vars(cls):
                found[cls.kind] = cls
    return found


# The payload class of each kind (what the attach side decodes an event's `data` as).
PAYLOADS: typing.Final[typing.Mapping[EventKind, type[Payload]]] = _kinds()


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

    @classmethod
    def from_dict(cls, data: dict[str, typing.Any]) -> Event:
        """An event from its JSON dict (the attach viewer's side): the payload rebuilt as its kind's class
        from its fields; a kind this side does not know, or fields it cannot take (a newer or older
        engine), come as `Other` with the level and message as sent."""
        message = str(data.get("message", ""))
        ts = float(data.get("ts", 0.0))
        fields = data.get("data")
        with contextlib.suppress(ValueError, TypeError):
            payload_cls = PAYLOADS[EventKind(str(data.get("kind")))]
            if fields is None and issubclass(payload_cls, Said):  # an engine from before the payloads: prose
                fields = {"line": message, "at": data.get("level"), "dataset": data.get("dataset", "")}
            if isinstance(fields, dict):
                names = {f.name for f in dataclasses.fields(payload_cls)}
                payload = payload_cls(**{k: v for k, v in fields.items() if k in names})
                if payload.at is not None:
                    payload = dataclasses.replace(payload, at=Level(payload.at))
                return cls(ts, payload, message)
        try:
            level = Level(str(data.get("level")))
        except ValueError:
            level = Level.INFO
        return cls(ts, Other(name=str(data.get("kind", "")), line=message, at=level,
                             dataset=str(data.get("dataset", "") or "")), message)
