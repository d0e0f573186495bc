"""Attempts: one prompt asked until it has an outcome.

Each response is classified by whose problem it is (core/generate/api/classify.py). The prompt's own
fails it; the dataset's and the account's hand it back unrecorded (it stays eligible) for the
engine to stop the dataset or the run's admission. Transient ones are retried with exponential
backoff and full jitter, honouring Retry-After, for as long as they last: the outage kinds
(connection, 408, 429, 5xx, the in-flight-budget 402) spend no attempt, so an outage of any length
fails no prompt; the answer kinds (a timeout, a cut-off body, a 200 carrying an error) spend one of
`engine.max_attempts` only while, since this prompt was first sent, the service has given the other
prompts more answers than answer faults: then the trouble is this prompt's, not the service's (in
an outage of such answers the others' faults outnumber the answers, and nothing fails). Only answers
to requests sent after this prompt's first try count there: requests sent before an outage are still
answered inside it, and under load they outnumbered its faults (a prompt failed by a 0.6 s outage). A
prompt left alone (nothing else of its dataset in flight, no other fault since its first try) has no
such evidence: its answer faults spend attempts, so a poison prompt at a dataset's end is not asked,
and paid for, forever. A 429 and
the in-flight-budget 402 feed the dataset's adaptive limit (AIMD), and so does a self-hosted server's
503 (vLLM's and SGLang's full queue). A drain gives a retrying prompt up unrecorded.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from draftgen.core.config import Config
from draftgen.core.errors import DiskError
from draftgen.core.generate.api.classify import ANSWER_KINDS, Whose, unreachable_advice
from draftgen.core.generate.api.client import ChatAnswer, ChatClient, RequestFailed
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.loop.run_state import RunControl
from draftgen.core.generate.loop.stats import Tally
from draftgen.core.generate.money.billing import as_booked, book_answer, book_failure, look_up, over_reservation
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger, Ticket
from draftgen.core.live.recent import RecentErrors
from draftgen.core.live.snapshot import EventKind, Level
from draftgen.core.secrets import Redactor

if TYPE_CHECKING:
    from draftgen.core.generate.loop.admission import Admission
    from draftgen.core.generate.loop.dataset_run import DatasetRun


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None,
                  rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt-1))]), never shorter than Retry-After."""
    delay = rng.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap * 5))
    return delay


ANSWER_BLOCK_BITS = 3  # answers are counted by blocks of 8 sends: a prompt's count starts at the next block


class Outcome(Enum):
    ANSWERED = "answered"    # record the answer
    FAILED = "failed"        # failed for a reason of its own: record the failure
    ACCOUNT = "account"      # the key or the account: hand the prompt back, stop admission run-wide
    DATASET = "dataset"      # the dataset's routing or settings: stop the dataset, the prompt stays eligible
    GIVEN_UP = "given_up"    # drained while retrying: not recorded, stays eligible
    OVER_BUDGET = "over_budget"  # max_usd leaves no room for a retry: not recorded, counted skipped
    UNSENT = "unsent"        # the disk refused the spend ledger's line: not sent, handed back


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class Attempted:
    outcome: Outcome
    attempts: int
    answer: ChatAnswer | None = None
    error: RequestFailed | None = None
    disk_error: DiskError | None = None
    seq: int = 0   # the dataset's count of requests sent when the last one of these left (DatasetRun.sent)


class Attempts:
    """Asks prompts with retries; counts retries and the kinds of error seen; notices outages."""

    def __init__(self, config: Config, gate: RunControl, errors: Tally, rng: random.Random, *, room: Admission,
                 spend: SpendLedger, client: ChatClient, settler: Settler, prices: Mapping[str, Prices | None],
                 on_event: Callable[..., None], redact: Redactor, clock: Callable[[], float],
                 recent: RecentErrors | None = None) -> None:
        self._config = config
        self._gate = gate
        self._errors = errors
        self._rng = rng
        self._room = room  # a retry's slot and reservation (admission.py)
        self._spend = spend
        self.settler = settler
        self.prices = prices  # per dataset (None: unknown)
        self._event = on_event
        self._redact = redact
        self._clock = clock
        self._recent = recent   # the drill-down's rings of recent errors
        self.client = client
        self.retries = 0
        self._unreachable_since: float | None = None  # the API could not be reached; reset by an answer
        self.answered = 0        # answers this run: a prompt that fails while others are answered is suspect
        self._sent = 0           # requests sent this run, numbered in the order they left
        self._answered_blocks: list[int] = []  # answers, by the block of ANSWER_BLOCK_BITS of their send number
        self.answer_faults = 0   # answer faults this run (ANSWER_KINDS)
        self.backing_off = 0     # requests waiting to retry a transient error right now
        self.last_transient: RequestFailed | None = None
        self.unreachable_cause = ""  # e.g. "cannot connect to 127.0.0.1:18799 (connection refused)"
        self._said: dict[tuple[EventKind, str], int] = {}  # (event kind, provider) -> times seen

    async def ask(self, ds: DatasetRun, body: dict[str, Any], ticket: Ticket) -> Attempted:
        """Ask until there is an outcome. Each attempt goes out under its own reservation (`ticket` for
        the first), on the spend ledger before it leaves, and is booked as it ends (billing.py): answered
        at its usage.cost, refused (nothing billed), or pending until the settler prices it."""
        eng = self._config.engine
        spend = self._spend
        prompt_id = ticket.prompt_id
        spent = 0   # attempts that count against max_attempts
        tries = 0   # requests sent
        # What the service did for the other prompts since this one's first try: more answers than
        # answer faults says it works, and this prompt's answer fault is its own; more says an outage.
        # Only answers to requests sent after that try count: requests sent before an outage still
        # being answered inside it say nothing of the service now.
        first_block, faults_before = (self._sent >> ANSWER_BLOCK_BITS) + 1, self.answer_faults
        own_faults = 0
        while True:
            if not ticket.open:  # a retry: the last reservation is settled or pending
                renewed = await self._room.reserve_retry(ds, prompt_id, ticket.worst)
                if renewed is None:
                    return Attempted(Outcome.GIVEN_UP if self._gate.closed else Outcome.OVER_BUDGET, tries)
                ticket = renewed
            try:
                await spend.send_grouped(ticket)  # durable (one fsync per batch) before the request leaves
            except DiskError as e:
                spend.release(ticket)
                return Attempted(Outcome.UNSENT, tries, disk_error=e)
            tries += 1
            seq = ds.note_sent()
            sent_no = self._sent
            self._sent += 1
            try:
                answer = await self.client.chat(body, functools.partial(spend.generation, ticket))
            except RequestFailed as e:
                self._note_failure(ds, ticket, tries, e)
                ended = self._ended_by(ds, prompt_id, tries, e, seq)
                if ended is not None:
                    return ended
                if e.unreachable:
                    self._note_unreachable(e)
                # An answer fault may be this prompt's; one coded as an outage (a 503 mid-stream) is not.
                if e.kind in ANSWER_KINDS and not e.outage:
                    self.answer_faults += 1
                    own_faults += 1
                    # Counted against the prompt only while the others get more answers than faults; an
                    # answer run past max_tokens was billed: it always counts (paid retries stay bounded).
                    others_faults = self.answer_faults - faults_before - own_faults
                    # Alone (nothing else of its dataset in flight, no other fault since its first try)
                    # there is no other evidence: its own faults count, or a poison prompt at a dataset's
                    # end would be asked, and paid for, forever.
                    alone = ds.in_flight - ds.parked <= 1 and not others_faults
                    if self._answered_since(first_block) > others_faults or alone or e.past_cap is not None:
                        spent += 1
                        if spent >= eng.max_attempts:
                            return self._failed(ds, prompt_id, tries, e, seq)
                given_up = await self._back_off(ds, tries, e)
                if given_up is not None:
                    return given_up
                continue
            except BaseException:  # stop-now (a cancel) mid-request: the provider may bill it anyway
                self._abandon(ticket)
                raise
            prices = self.prices.get(ds.config.name)
            look_up(self.settler, book_answer(spend, ticket, answer, prices))
            answer = as_booked(answer, ticket, prices)  # the record's cost is what the ledger booked
            over = over_reservation(answer, ticket, prices)
            if over:
                self._say(EventKind.OVER_RESERVATION, ds, answer.provider or "",
                          f"prompt {prompt_id!r} billed ${ticket.worst + over:.6f}, ${over:.6f} past its reservation "
                          f"of ${ticket.worst:.6f}: booked at what it billed, so max_usd counts it")
            ds.concurrency.on_response()
            self.answered += 1
            blocks, block = self._answered_blocks, sent_no >> ANSWER_BLOCK_BITS
            while len(blocks) <= block:
                blocks.append(0)
            blocks[block] += 1
            self._note_reachable()
            return Attempted(Outcome.ANSWERED, tries, answer=answer, seq=seq)

    def _answered_since(self, first_block: int) -> int:
        """Answers to requests sent from block `first_block` on (blocks of 2**ANSWER_BLOCK_BITS sends)."""
        return sum(self._answered_blocks[first_block:])

    def _note_failure(self, ds: DatasetRun, ticket: Ticket, tries: int, e: RequestFailed) -> None:
        """A failed attempt on the ledger, in the error tallies, and as feedback to the dataset's concurrency."""
        look_up(self.settler, book_failure(self._spend, ticket, e, self.prices.get(ds.config.name),
                                           self_hosted=self._config.api.self_hosted))
        if e.past_cap is not None:
            self._say(EventKind.PAST_CAP, ds, e.provider, f"prompt {ticket.prompt_id!r}: {self._redact(e.message)}; "
                      "booked at what it billed, the prompt is asked again (docs/money.md)")
        self._errors.add(e.kind)
        if self._recent is not None:
            self._recent.add(kind=str(e.kind), dataset=ds.config.name, prompt_id=ticket.prompt_id, attempt=tries,
                             message=self._redact(e.message), status=e.status, provider=e.provider)
        if e.slows_down(self._config.api.self_hosted):
            ds.concurrency.on_429()
        elif not e.unreachable:
            ds.concurrency.on_response()

    def _say(self, kind: EventKind, ds: DatasetRun, provider: str, what: str) -> None:
        """A provider's billing past what was asked: said the 1st, 10th, 100th... time per provider."""
        name = self._redact(provider) or "(unnamed provider)"
        n = self._said[kind, name] = self._said.get((kind, name), 0) + 1
        if n == 1 or (n % 10 == 0 and str(n).rstrip("0") == "1"):
            again = f" ({n} times so far)" if n > 1 else ""
            self._event(Level.WARN, kind, f"{ds.config.name}: provider {name}{again}: {what}", dataset=ds.config.name)

    def _ended_by(self, ds: DatasetRun, prompt_id: str, tries: int, e: RequestFailed, seq: int) -> Attempted | None:
        """The outcome when the error is the account's, the dataset's or the prompt's own (no retry helps)."""
        whose = e.whose
        if whose is Whose.ACCOUNT:
            return Attempted(Outcome.ACCOUNT, tries, error=e)
        if whose is Whose.DATASET:
            return Attempted(Outcome.DATASET, tries, error=e)
        if whose is Whose.PROMPT:
            return self._failed(ds, prompt_id, tries, e, seq)
        return None

    async def _back_off(self, ds: DatasetRun, tries: int, e: RequestFailed) -> Attempted | None:
        """Wait out a transient error and a slot for the retry; GIVEN_UP instead when the run stops meanwhile."""
        if self._gate.closed:
            return Attempted(Outcome.GIVEN_UP, tries - 1, error=e)
        self.retries += 1
        self.backing_off += 1
        try:
            # Retries go on while the run is paused: a request in flight finishes (an account
            # condition answers it at once and hands the prompt back).
            await asyncio.sleep(backoff_delay(min(tries, 16), self._config.engine.backoff_base_s,
                                              self._config.engine.backoff_max_s, e.retry_after, self._rng))
        finally:
            self.backing_off -= 1
            self.last_transient = e
        if self._gate.closed:
            return Attempted(Outcome.GIVEN_UP, tries, error=e)
        await self._room.retry_slot(ds)
        return None

    def stalled(self, in_flight: int) -> str:
        """Why no answer comes while the run goes, in a sentence (empty when answers come)."""
        since = self._unreachable_since
        if since is not None:
            cause = self.unreachable_cause or f"{self._config.api.base_url} does not answer"
            return (f"{cause} for {self._clock() - since:.0f} s; retrying until it answers "
                    f"({unreachable_advice(self._config.api.base_url, cause)}), no prompt is failed meanwhile")
        last = self.last_transient
        if self.backing_off and self.backing_off >= in_flight and last is not None:
            wait = f", Retry-After {last.retry_after:g} s" if last.retry_after is not None else ""
            return (f"all {self.backing_off} requests in flight are backing off a transient error "
                    f"({last.kind}{wait}): {self._redact(last.message)[:120]}")
        return ""

    def _failed(self, ds: DatasetRun, prompt_id: str, tries: int, e: RequestFailed, seq: int) -> Attempted:
        if self._recent is not None:
            self._recent.mark_final(ds.config.name, prompt_id)
        return Attempted(Outcome.FAILED, tries, error=e, seq=seq)

    def _abandon(self, ticket: Ticket) -> None:
        look_up(self.settler, self._spend.abandoned(ticket))

    def _note_unreachable(self, e: RequestFailed) -> None:
        self.unreachable_cause = self._redact(e.message)[:200]
        if self._unreachable_since is None:
            self._unreachable_since = self._clock()
            # The cause once (it names the address), the advice that matches it, then what the run does.
            cause = self.unreachable_cause
            advice = unreachable_advice(self._config.api.base_url, cause, self._config.path)
            self._event(Level.WARN, EventKind.UNREACHABLE, f"{cause}: {advice}; retrying until it answers, no prompt "
                        "is failed meanwhile")

    def _note_reachable(self) -> None:
        if self._unreachable_since is not None:
            self._event(Level.INFO, EventKind.REACHABLE, f"{self._config.api.base_url} answers again after "
                        f"{self._clock() - self._unreachable_since:.0f} s out of reach")
            self._unreachable_since = None
