"""The payload classes (core/live/events.py) of generation: datasets, prompts, money, providers and
servers; each carries its figures typed and renders its message, prose from elsewhere (a server's
error, an alert) in a field named for what it is. The stages' and the run frame's are in
core/live/stage_payloads.py. `PAYLOADS`: each kind's class, of both modules."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from draftgen.core.live import stage_payloads  # noqa: F401 - its classes are in PAYLOADS too
from draftgen.core.live.events import EventKind, Level, Payload
from draftgen.core.units import usd


@dataclass(frozen=True, kw_only=True)
class AccountChanged(Payload):
    """ACCOUNT: an account condition stopped admission (`alert`: the alert it raises), or `cleared`
    (the condition, with the `balance` read)."""
    kind = EventKind.ACCOUNT
    usual = Level.ERROR
    alert: str = ""
    cleared: str = ""
    balance: str = ""

    def text(self) -> str:
        return f"{self.cleared} cleared ({self.balance}): resuming" if self.cleared else self.alert


@dataclass(frozen=True, kw_only=True)
class Alert(Payload):
    """ALERT: the run's alert bar changed (`alert`: what it says)."""
    kind = EventKind.ALERT
    usual = Level.ERROR
    alert: str

    def text(self) -> str:
        return self.alert


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


@dataclass(frozen=True, kw_only=True)
class BadBill(Payload):
    """BAD_BILL: an answer's cost or token counts not believed (billing.py `doubt`): booked at `instead`;
    or its generation record's cost (`by_record`, `doubt` the figure) settled at `counted_usd`."""
    kind = EventKind.BAD_BILL
    usual = Level.WARN
    prompt_id: str
    doubt: str
    provider: str = ""
    instead: str = ""
    by_record: bool = False
    counted_usd: float = 0.0

    def text(self) -> str:
        if self.by_record:
            return (f"{self.dataset}: prompt {self.prompt_id!r}: its generation record says it cost {self.doubt}, "
                    f"which is not believed (settle.py): settled at what it counted at, ${self.counted_usd:.6f}")
        return (f"{self.dataset}: provider {self.provider}: prompt {self.prompt_id!r} came with {self.doubt}: not "
                f"booked as given but at {self.instead}; the answer is kept. Said once per kind; each such answer "
                "is counted as bad_bill")


@dataclass(frozen=True, kw_only=True)
class Budget(Payload):
    """BUDGET: a token or money budget (`reason`) skipped the rest of a dataset, or one prompt
    (`prompt_id`, the next ones go on); or a conversation (`conversation`) ended at `turn` of `turns`
    because of it, its `later` turns skipped."""
    kind = EventKind.BUDGET
    usual = Level.WARN
    reason: str
    prompt_id: str = ""
    conversation: str = ""
    turn: int = 0
    turns: int = 0
    later: int = 0

    def text(self) -> str:
        if self.conversation:
            return _ended(self.dataset, self.conversation, self.turn, self.turns, self.reason, self.later)
        if self.prompt_id:
            return (f"{self.dataset}: prompt {self.prompt_id!r} skipped: {self.reason}; it stays eligible for a later "
                    "run, and the next prompts go on (each one that does not fit is skipped and counted)")
        return f"{self.dataset}: {self.reason}; the rest is skipped (stays eligible for a later run)"


@dataclass(frozen=True, kw_only=True)
class CreditsRead(Payload):
    """CREDITS: the balance as read (`balance`: not a figure the run can use), or why it could not be
    read (`cause`)."""
    kind = EventKind.CREDITS
    usual = Level.WARN
    balance: str = ""
    cause: str = ""

    def text(self) -> str:
        if self.cause:
            return f"could not read the balance: {self.cause}"
        return f"balance {self.balance}; the run keeps going under max_usd"


@dataclass(frozen=True, kw_only=True)
class Concurrency(Payload):
    """CONCURRENCY: a dataset's adaptive limit (core/generate/loop/concurrency.py), or a fleet server's
    (`server`), moved (`reason`): a 429 storm began and cut it `before` → `after` ("storm": `rate_limited`
    of the `sent` attempts of the last `window_s` seconds were, the storm rule being `min_rate_limited`+
    and `min_share`+, one cut at most every `cut_every_s`); the storm ended ("over", after `lasted_s`:
    `rate_limited` in all, `cuts`, the limit down from `before` to `after` at the lowest); or the limit
    grew from `before` back to `after`, the `configured` value ("back")."""
    kind = EventKind.CONCURRENCY
    usual = Level.WARN
    reason: typing.Literal["storm", "over", "back"] = "storm"
    before: int = 0
    after: int = 0
    configured: int = 0
    rate_limited: int = 0
    sent: int = 0
    window_s: float = 0.0
    min_rate_limited: int = 0
    min_share: float = 0.0
    cut_every_s: float = 0.0
    lasted_s: float = 0.0
    cuts: int = 0
    server: str = ""

    @property
    def starts(self) -> bool:
        """A storm began (the limit cut); else it ended, or the limit is back."""
        return self.reason == "storm"

    @property
    def level(self) -> Level:
        return self.at or (Level.WARN if self.starts else Level.INFO)

    def text(self) -> str:
        if self.starts:
            said = (f"429 storm: {self.rate_limited:,} of the {self.sent:,} attempts sent in the last "
                    f"{self.window_s:g} s were rate-limited (a storm is {self.min_rate_limited}+ and "
                    f"{self.min_share:.0%}+); limit cut {self.before:,} → {self.after:,} (30% at most every "
                    f"{self.cut_every_s:g} s while it lasts, then +2% of {self.configured:,} a second)")
        elif self.reason == "over":
            said = (f"429 storm over after {self.lasted_s:.0f} s: {self.rate_limited:,} rate-limited, {self.cuts} "
                    f"cut(s), lowest limit {self.after:,}; growing back to {self.configured:,}")
        else:
            said = f"limit back at the configured {self.configured:,}"
        if self.server:
            said = f"server {self.server}: {said}"
        return f"{self.dataset}: {said}" if self.dataset else said


@dataclass(frozen=True, kw_only=True)
class ConversationEnded(Payload):
    """CONVERSATION: a conversation (`conversation`) ended early at `turn` of `turns` (`why`), its
    `later` turns skipped; or its turn `turn` was edited in the prompt file (`path` line `line_no`)."""
    kind = EventKind.CONVERSATION
    conversation: str
    turn: int
    turns: int = 0
    why: str = ""
    later: int = 0
    path: str = ""
    line_no: int = 0

    def text(self) -> str:
        if self.path:
            return (f"{self.dataset}: {self.path} line {self.line_no}: turn {self.turn} of conversation "
                    f"{self.conversation!r} is not the one its stored answer was asked with (the prompt file was "
                    "edited since): the conversation is not continued (its stored turns stay, its rest is counted "
                    "skipped); every such conversation is counted")
        return _ended(self.dataset, self.conversation, self.turn, self.turns, self.why, self.later)


def _ended(dataset: str, conversation: str, turn: int, turns: int, why: str, later: int) -> str:
    return (f"{dataset}: conversation {conversation!r} ended at turn {turn} of {turns}: {why}; its {later} later "
            "turn(s) are skipped (nothing is asked on a broken answer); every conversation that ends early is "
            "counted")


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
class PendingAttempts(Payload):
    """PENDING: `attempts` of earlier runs not priced yet, or priced now; `case` says which: "open" (at
    the start: `worst_usd` counted, `looked_up` now, `unknown` without a generation id priced from the
    key's usage in `due_s`, or kept at worst case when `due_s` is None), "key_priced" (priced `usd`
    together from the key's usage, `worst_usd` at worst case), "recorded" (their answers found in
    `responses`, settled at `usd`), "waits" (max_usd waits `due_s` for the key's usage to price them)."""
    kind = EventKind.PENDING
    case: str
    attempts: int
    usd: float = 0.0
    worst_usd: float = 0.0
    looked_up: int = 0
    unknown: int = 0
    due_s: float | None = None
    responses: str = ""

    def text(self) -> str:
        n = self.attempts
        if self.case == "key_priced":
            return (f"{n} attempt(s) without a generation id priced from the key's usage since the directory's "
                    f"first run: {usd(self.usd)} together (they counted {usd(self.worst_usd)} at worst case)")
        if self.case == "recorded":
            return (f"{self.dataset}: {n} attempt(s) an earlier run left open have their answer in {self.responses} "
                    f"(written before the ledger's line, or imported from a spool): settled at their recorded cost, "
                    f"{usd(self.usd)}")
        if self.case == "waits":
            return (f"max_usd has no room now but for {n} attempt(s) without a generation id (counted at worst case, "
                    f"{usd(self.worst_usd)}): the run waits for the key's usage to price them, in "
                    f"{self.due_s or 0:.0f} s at most (api.request_timeout_s after the last was sent), then goes on")
        unknown = self.unknown
        return (f"{n} attempt(s) of earlier runs not priced yet count at their worst case ({usd(self.worst_usd)}); "
                f"{self.looked_up} looked up now"
                + (f", {unknown} without a generation id priced from the key's usage once they cannot still be "
                   f"running (in {self.due_s:.0f} s at most)" if unknown and self.due_s is not None
                   else f", {unknown} without a generation id stay at worst case (no key usage baseline)"
                   if unknown else ""))


@dataclass(frozen=True, kw_only=True)
class PriceNote(Payload):
    """PRICES: a dataset's worst-case `prices` (as `Prices.describe` says them), or why none is known
    (`cause`); a raise of them (`raised`: what the price check says); or the datasets (`wave`) held at
    `first_wave` requests in flight until a first bill checks the listed prices."""
    kind = EventKind.PRICES
    prices: str = ""
    cause: str = ""
    raised: str = ""
    wave: str = ""
    first_wave: int = 0

    def text(self) -> str:
        if self.wave:
            return (f"{self.wave}: at most {self.first_wave} requests in flight until the first answer comes back, "
                    "its bill checking the listed prices (then each dataset's concurrency)")
        if self.raised:
            return f"{self.dataset}: {self.raised}"
        if self.prices:
            return f"{self.dataset}: worst case {self.prices}"
        return f"{self.dataset}: no price known ({self.cause}); no ceiling is set"


@dataclass(frozen=True, kw_only=True)
class Provider(Payload):
    """PROVIDER: a provider gone `bad` (most of its last attempts failed), or back; `detail`: what its
    recent figures say (core/generate/recent.py)."""
    kind = EventKind.PROVIDER
    usual = Level.WARN
    detail: str
    bad: bool = True

    @property
    def level(self) -> Level:
        return self.at or (Level.WARN if self.bad else Level.INFO)

    def text(self) -> str:
        return self.detail


@dataclass(frozen=True, kw_only=True)
class ProviderFlagged(Payload):
    """PROVIDER_FLAGGED: a provider's token counts depart from the others' (`cause`: how, as fidelity says it)."""
    kind = EventKind.PROVIDER_FLAGGED
    usual = Level.WARN
    provider: str
    cause: str

    def text(self) -> str:
        return f"provider {self.provider}: {self.cause} (`draftgen tokens` prints what to change)"


@dataclass(frozen=True, kw_only=True)
class Reachable(Payload):
    """REACHABLE: a server (`url`) answers again after `out_s` out of reach; or a fleet's server is
    back (`detail`: as the fleet says it)."""
    kind = EventKind.REACHABLE
    url: str = ""
    out_s: float = 0.0
    detail: str = ""

    def text(self) -> str:
        return self.detail or f"{self.url} answers again after {self.out_s:.0f} s out of reach"


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
class RequestError(Payload):
    """REQUEST_ERROR: a request ended on an error of the engine's own (a bug); `cause`: the error."""
    kind = EventKind.REQUEST_ERROR
    usual = Level.ERROR
    prompt_id: str
    cause: str

    def text(self) -> str:
        return (f"{self.dataset}: prompt {self.prompt_id!r} not asked again this run: the engine's own error "
                f"{self.cause}")


@dataclass(frozen=True, kw_only=True)
class RequestKeys(Payload):
    """REQUEST_KEYS: what the requests carry: streamed, because the smoke test (`smoke_json`) found the
    non-streamed answers of `url` rewritten; or a key the server kind ignores (`detail`: the config's
    warning)."""
    kind = EventKind.REQUEST_KEYS
    url: str = ""
    smoke_json: str = ""
    detail: str = ""

    def text(self) -> str:
        return self.detail or (f"requests stream: the smoke test found the non-streamed answers of {self.url} "
                               f"rewritten by its parser ({self.smoke_json}; [api] stream overrides it)")


@dataclass(frozen=True, kw_only=True)
class ServerIds(Payload):
    """SERVER_IDS: the self-hosted server's token ids: how they are `asked`, or why they cannot be or
    are missing (`detail`: as core/api/server_ids.py says it)."""
    kind = EventKind.SERVER_IDS
    usual = Level.WARN
    detail: str
    asked: bool = False

    @property
    def level(self) -> Level:
        return self.at or (Level.INFO if self.asked else Level.WARN)

    def text(self) -> str:
        return self.detail


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


@dataclass(frozen=True, kw_only=True)
class Unreachable(Payload):
    """UNREACHABLE: a server cannot be reached (`cause`, naming the address; a fleet's server taken out
    as the fleet says it), with the `advice` that matches it; `at_start`: the start-up check found it,
    the smoke test needed first retrying for `smoke_retry_s` (0: no smoke test waits)."""
    kind = EventKind.UNREACHABLE
    usual = Level.WARN
    cause: str
    advice: str = ""
    at_start: bool = False
    smoke_retry_s: float = 0.0

    def text(self) -> str:
        if self.at_start:
            return self.cause + (f"; the smoke test needed first retries it for up to {self.smoke_retry_s / 60:.0f} "
                                 "min, then the run stops" if self.smoke_retry_s
                                 else "; the run waits for it (no prompt is failed meanwhile)")
        if self.advice:
            return f"{self.cause}: {self.advice}; retrying until it answers, no prompt is failed meanwhile"
        return self.cause


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
