"""One payload class per `EventKind` (core/live/events.py), with its figures typed and its message;
a kind whose words are prose from elsewhere is a `Said`. `PAYLOADS`: each kind's class."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from draftgen.core.live.events import EventKind, Level, Payload, Said
from draftgen.core.units import usd


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
