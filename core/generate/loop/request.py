"""One request, from its admission to its record, in this one file.

A request coroutine of its dataset (admission.py) pulls a prompt from the dataset's source (source.py)
and offers it here (`Requests.offer`), then asks the request it admitted (`Requests.ask`); the rest of
its life is this module's, in order:

1. admit: the body this prompt's request sends and the worst case of that very body; room for it
   (room.py: the gate, the dataset's doubts, token budget, max_usd and credit floor, its concurrency);
   a prompt another dataset answered or is answering is skipped instead (duplicates.py);
2. reserve: that worst case on the spend ledger (a `Ticket`), the request in flight in its dataset;
3. attempt and retry (`_ask`): each attempt on the ledger before it leaves, booked as it ends
   (billing.py); transient errors retried with backoff under a new reservation each (room.py:
   `reserve_retry`, `retry_slot`), for as long as an outage lasts;
4. book (`_book`): the outcome, decided by whose problem the last response was (classify.py);
5. record: an answer or failure line through the record book (record_book.py), fsynced before the
   request ends; the source told what became of the prompt (`Booked`), once.

Retries. Each response is classified by whose problem it is. The prompt's own fails it; the
dataset's and the account's hand it back unrecorded (it stays eligible) and stop the dataset or the
run's admission. Transient ones are retried with exponential backoff and full jitter, honouring
Retry-After: the outage kinds (connection, 408, 429, 5xx, the in-flight-budget 402) spend no
attempt, so an outage of any length fails no prompt; the answer kinds (a timeout, a cut-off body, a
200 carrying an error) spend one of `engine.max_attempts` only while, since this prompt was first
sent, the service has given the other prompts more answers than answer faults: then the trouble is
this prompt's, not the service's. Only answers to requests sent after this prompt's first try count
(counted by blocks of 8 sends): requests sent before an outage are still answered inside it. A prompt
left alone (nothing else of its dataset in flight, no other fault since its first try) has no such
evidence: its answer faults spend attempts, so a poison prompt at a dataset's end is not asked, and
paid for, forever. A 429 and the in-flight-budget 402 feed the dataset's adaptive limit (AIMD), and
so does a self-hosted server's 503. A drain gives a retrying prompt up unrecorded. A paused run sends
nothing, retries included: a request that must retry while the run is paused or held hands its prompt
back (unrecorded, asked once the run goes on), and an attempt whose run was paused or held while its
`sent` line was being made durable does not leave: it is booked refused on the ledger (nothing billed)
and its prompt handed back.

Each request runs in one of its dataset's request coroutines (admission.py), which admits it and
then asks it here (`ask`): what it holds (its slot, its reservation, its tokens in flight, its
dataset's probe, its claim on the prompt against other datasets) is released in a `finally` as it
ends, however it ends. A request whose outcome was never booked is booked there: HANDED_BACK when it
was cancelled (stop now), FAILED (for its source only: nothing is written) when it ended on an error
of the engine's own, which asking it again would only repeat; either way it stays eligible for the
next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from draftgen.core.config_tables import sampling_of
from draftgen.core.errors import DiskError
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import ANSWER_KINDS, Whose, unreachable_advice
from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.api.preflight import detect_server
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.room import Admit, Decision, Room
from draftgen.core.generate.loop.run_state import Hold
from draftgen.core.generate.loop.source import HANDED_BACK, TAKEN_ELSEWHERE, Booked, PromptSource
from draftgen.core.generate.money.billing import (
    as_booked,
    believed,
    book_answer,
    book_failure,
    look_up,
    over_reservation,
)
from draftgen.core.generate.money.spend import SpendLedger, Ticket
from draftgen.core.live import events as ev
from draftgen.core.live.events import EventKind, Level
from draftgen.core.records import ErrorKind
from draftgen.core.servers import ids_plan, missing_ids_message

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun
    from draftgen.core.generate.loop.opening import Opened
    from draftgen.core.generate.loop.record_book import RecordBook
    from draftgen.core.generate.loop.watch import AccountWatch


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None,
                  rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt-1))]), never shorter than Retry-After."""
    delay = rng.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap * 5))
    return delay


ENDED_ON_ERROR = Booked.failed("its request ended on an error of the engine's own")
ANSWER_BLOCK_BITS = 3  # answers are counted by blocks of 8 sends: a prompt's count starts at the next block


class Outcome(Enum):
    ANSWERED = "answered"    # record the answer
    FAILED = "failed"        # failed for a reason of its own: record the failure
    ACCOUNT = "account"      # the key or the account: hand the prompt back, stop admission run-wide
    DATASET = "dataset"      # the dataset's routing or settings: stop the dataset, the prompt stays eligible
    GIVEN_UP = "given_up"    # drained, or paused, while retrying: not recorded, stays eligible
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


class Request:
    """One admitted prompt in flight: the body it sends, what it holds until it ends, and whether its
    source was told."""
    __slots__ = ("ds", "prompt", "source", "body", "ticket", "expected", "probe", "booked")

    def __init__(self, ds: DatasetRun, prompt: Prompt, source: PromptSource, body: dict[str, Any], ticket: Ticket,
                 expected: int, probe: bool) -> None:
        self.ds = ds
        self.prompt = prompt
        self.source = source
        self.body = body
        self.ticket = ticket      # the first attempt's reservation (released when the request ends)
        self.expected = expected  # its tokens counted in flight against the dataset's token budget
        self.probe = probe        # the one request of a dataset held by its doubts (doubts.py)
        self.booked = False

    def book(self, result: Booked) -> None:
        """Tell the source what became of the prompt (the first outcome booked is the one)."""
        if not self.booked:
            self.booked = True
            self.source.booked(self.prompt, result)


class Requests:
    """Every request of a run, each from its admission to its record; counts retries and the kinds of
    error seen, notices outages."""

    def __init__(self, ctx: RunContext, opened: Opened, *, room: Room, book: RecordBook, watch: AccountWatch,
                 spend: SpendLedger, datasets: dict[str, DatasetRun], rng: random.Random) -> None:
        self._ctx = ctx
        self._room = room
        self._book = book
        self._watch = watch
        self._spend = spend
        self._datasets = datasets
        self._rng = rng
        self.client = opened.client
        self.settler = opened.costs.settler
        self.prices = opened.costs.prices  # per dataset (None: unknown)
        self.duplicates = opened.duplicates  # None: off, or only one dataset
        self.tasks: set[asyncio.Task[Any]] = set()  # the coroutines asking a request now (stop now cancels them)
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
        self._doubts_said: set[str] = set()  # the kinds of bill not believed, said once each
        api = ctx.config.api
        self._wants_ids = api.return_token_ids and api.server.kind.returns_ids
        self._ids_said = False  # why answers come without the server's ids was said

    # -- 1. admit, 2. reserve ------------------------------------------------------------------------

    async def offer(self, ds: DatasetRun, prompt: Prompt, source: PromptSource) -> tuple[Decision, Request | None]:
        """Wait for room for the prompt's request and admit it (GO, with the request to `ask`), or skip it
        (SKIP: max_usd has no room for it; a GO whose prompt another dataset has is skipped too, with no
        request), or give it back to its source (HALT); BUDGET leaves it with the caller, whose dataset
        the budget ends."""
        body, worst = self._room.request_for(ds, prompt)
        decision = self._room.admit_now(ds, worst)
        if decision is None:
            try:
                decision = await self._room.admit(ds, worst)
            except asyncio.CancelledError:  # the run cancelled while it waited: the prompt stays eligible
                source.booked(prompt, HANDED_BACK)
                raise
        verdict = decision.verdict
        if verdict is Admit.GO:
            if not self._taken_elsewhere(ds, prompt):
                return decision, self._admitted(ds, prompt, source, body, worst)
            source.booked(prompt, TAKEN_ELSEWHERE)
        elif verdict is Admit.HALT:
            source.booked(prompt, HANDED_BACK)
        elif verdict is Admit.SKIP:
            self._room.skip_for_money(ds, prompt.id, decision.reason)
            source.booked(prompt, Booked.skipped(decision.reason))
        return decision, None

    def _taken_elsewhere(self, ds: DatasetRun, prompt: Prompt) -> bool:
        """Skip (counted, and said once per dataset) a prompt another dataset answered or is answering;
        otherwise the prompt is this dataset's while it is in flight (core/generate/loop/duplicates.py)."""
        if self.duplicates is None:
            return False
        other = self.duplicates.claim(ds.config.name, prompt.id, prompt.messages, turn=ds.config.turns == "all")
        if other is None:
            return False
        ds.skipped_some()
        if self.duplicates.skip(ds.config.name) == 1:
            self._ctx.event(ev.Duplicate(prompt_id=prompt.id, other=other, dataset=ds.config.name))
        return True

    def _admitted(self, ds: DatasetRun, prompt: Prompt, source: PromptSource, body: dict[str, Any],
                  worst: float) -> Request:
        """The worst case of the body it sends reserved, the request counted in flight: `ask` it next."""
        req = Request(ds, prompt, source, body, self._spend.reserve(ds.config.name, prompt.id, worst),
                      ds.token_budget.expected(), ds.doubts.held)  # doubts.py: while held, one request at a time
        ds.request_started(req.expected, probe=req.probe)
        return req

    async def ask(self, req: Request) -> None:
        """The admitted request asked until it has an outcome (under the body its ticket reserved for), the
        outcome booked and recorded, durable (group fsync) before it ends; what it held is released as it
        ends, however it ends (a stop now cancels it: its prompt is handed back)."""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            if self._book_outcome(req, await self._ask(req.ds, req.body, req.ticket), req.body):
                await self._book.synced(req.ds)
        except Exception as exc:  # an error of the engine's own: not asked again this run, said with its cause
            if not req.booked:
                req.book(ENDED_ON_ERROR)
                self._ctx.event(ev.RequestError(prompt_id=req.prompt.id, cause=f"{type(exc).__name__}: {exc}",
                                                dataset=req.ds.config.name))
        finally:
            self.tasks.discard(task)
            self._release(req)

    def _release(self, req: Request) -> None:
        """What the request held, released; its dataset (or, money being shared, every dataset) woken."""
        ds = req.ds
        ds.request_ended(req.expected, probe=req.probe)
        self._spend.release(req.ticket)  # never sent: nothing to settle
        req.book(HANDED_BACK)  # its outcome never decided (stop now cancelled it): stays eligible for the next run
        if self.duplicates is not None:
            self.duplicates.settled(ds.config.name, req.prompt.id)
        if len(self._datasets) == 1:
            ds.wake.set()
        else:
            for d in self._datasets.values():
                d.wake.set()

    # -- 3. attempt and retry ------------------------------------------------------------------------

    async def _ask(self, ds: DatasetRun, body: dict[str, Any], ticket: Ticket) -> Attempted:
        """Ask until there is an outcome. Each attempt goes out under its own reservation (`ticket` for
        the first), on the spend ledger before it leaves, and is booked as it ends (billing.py): answered
        at its usage.cost, refused (nothing billed), or pending until the settler prices it."""
        spend = self._spend
        prompt_id = ticket.prompt_id
        spent = 0   # attempts that count against max_attempts
        tries = 0   # requests sent
        # What the service did for the other prompts since this one's first try (module docstring).
        first_block, faults_before = (self._sent >> ANSWER_BLOCK_BITS) + 1, self.answer_faults
        own_faults = 0
        while True:
            if not ticket.open:  # a retry: the last reservation is settled or pending
                renewed = await self._room.reserve_retry(ds, prompt_id, ticket.worst)
                if renewed is None:
                    return Attempted(Outcome.GIVEN_UP if self._ctx.control.closed else Outcome.OVER_BUDGET, tries)
                ticket = renewed
            try:
                await spend.send_grouped(ticket)  # durable (one fsync per batch) before the request leaves
            except DiskError as e:
                spend.release(ticket)
                return Attempted(Outcome.UNSENT, tries, disk_error=e)
            if not self._ctx.control.is_open:
                # Paused or held (an account's 402) while its sent line was made durable: it has not left,
                # so it does not, a retry no more than a first attempt (a drain lets what it admitted go
                # out and finish); the ledger says so (refused, nothing billed) and the prompt is handed
                # back, asked once the run goes on.
                spend.refused(ticket)
                return Attempted(Outcome.GIVEN_UP, tries)
            tries += 1
            seq = ds.note_sent()
            sent_at = ds.concurrency.on_send()
            sent_no = self._sent
            self._sent += 1
            try:
                answer = await self.client.chat(body, functools.partial(spend.generation, ticket),
                                                details=ds.config.turns == "all")  # passed back next turn
            except RequestFailed as e:
                self._note_failure(ds, ticket, tries, e, body, sent_at)
                ended = self._ended_by(ds, prompt_id, tries, e, seq)
                if ended is not None:
                    return ended
                if e.unreachable:
                    self._note_unreachable(e)
                # An answer fault may be this prompt's; one coded as an outage (a 503 mid-stream) is not.
                if e.kind in ANSWER_KINDS and not e.outage:
                    self.answer_faults += 1
                    own_faults += 1
                    if self._spends_attempt(ds, e, first_block, self.answer_faults - faults_before - own_faults):
                        spent += 1
                        if spent >= self._ctx.config.engine.max_attempts:
                            return self._failed(ds, prompt_id, tries, e, seq)
                    if e.kind is ErrorKind.BAD_BODY and (broken := ds.unreadable(e)) is not None:
                        return Attempted(Outcome.DATASET, tries, error=broken)  # the server's: it stops
                given_up = await self._back_off(ds, tries, e)
                if given_up is not None:
                    return given_up
                continue
            except BaseException:  # stop-now (a cancel) mid-request: the provider may bill it anyway
                look_up(self.settler, spend.abandoned(ticket))
                raise
            return self._answered(ds, ticket, answer, tries, seq, sent_no, body)

    def _spends_attempt(self, ds: DatasetRun, e: RequestFailed, first_block: int, others_faults: int) -> bool:
        """An answer fault counts against the prompt only while the other prompts got more answers than
        faults since its first try, or while it is alone; an answer run past max_tokens was billed: it
        always counts (paid retries stay bounded)."""
        # Alone (nothing else of its dataset in flight, no other fault since its first try) there is no
        # other evidence: its own faults count, or a poison prompt at a dataset's end would be asked, and
        # paid for, forever.
        alone = ds.in_flight - ds.parked <= 1 and not others_faults
        return sum(self._answered_blocks[first_block:]) > others_faults or alone or e.past_cap is not None

    def _answered(self, ds: DatasetRun, ticket: Ticket, answer: ChatAnswer, tries: int, seq: int,
                  sent_no: int, body: dict[str, Any]) -> Attempted:
        """An answer booked on the ledger at what it billed (what of its bill is believed: billing.py), its
        bill held against the dataset's prices (trust.py), and counted as the service's evidence."""
        name = ds.config.name
        prices = self.prices.get(name)
        answer = believed(answer, ticket, prices, body)
        if answer.doubt:
            self._doubted(ds, ticket, answer)
        self._room.trust.billed(name, answer, f"prompt {ticket.prompt_id!r}")
        look_up(self.settler, book_answer(self._spend, ticket, answer, prices))
        answer = as_booked(answer, ticket, prices)  # the record's cost is what the ledger booked
        over = over_reservation(answer, ticket, prices)
        if over:
            self._say(EventKind.OVER_RESERVATION, answer.provider or "", lambda name, n: ev.OverReservation(
                provider=name, times=n, prompt_id=ticket.prompt_id, reserved_usd=ticket.worst,
                billed_usd=ticket.worst + over, dataset=ds.config.name))
        self.answered += 1
        blocks, block = self._answered_blocks, sent_no >> ANSWER_BLOCK_BITS
        while len(blocks) <= block:
            blocks.append(0)
        blocks[block] += 1
        if (since := self._unreachable_since) is not None:
            self._note_reachable(since)
        return Attempted(Outcome.ANSWERED, tries, answer=answer, seq=seq)

    def _note_failure(self, ds: DatasetRun, ticket: Ticket, tries: int, e: RequestFailed,
                      body: dict[str, Any], sent_at: float) -> None:
        """A failed attempt on the ledger, in the error tallies, and as feedback to the dataset's concurrency."""
        ctx = self._ctx
        kind = ctx.config.api.server.kind
        look_up(self.settler, book_failure(self._spend, ticket, e, self.prices.get(ds.config.name),
                                           bills_answers=kind.bills_answers, body=body))
        if e.past_cap is not None:
            self._say(EventKind.PAST_CAP, e.provider, lambda name, n: ev.ProviderPastCap(
                provider=name, times=n, prompt_id=ticket.prompt_id, cause=ctx.redact(e.message),
                dataset=ds.config.name))
        ctx.errors.add(e.kind)
        ctx.recent.add(kind=str(e.kind), dataset=ds.config.name, prompt_id=ticket.prompt_id, attempt=tries,
                       message=ctx.redact(e.message), status=e.status, provider=e.server or e.provider)
        if e.slows_down(kind.full_at_503) and not e.fleet_limited:  # a fleet's server's own limit took it
            ds.concurrency.on_429(sent_at)

    def _doubted(self, ds: DatasetRun, ticket: Ticket, answer: ChatAnswer) -> None:
        """An answer whose bill is not believed (billing.py `believed`): counted (bad_bill), and said once per
        kind of doubt with what it is booked at instead."""
        self._ctx.errors.add(ErrorKind.BAD_BILL)
        if answer.doubt in self._doubts_said:
            return
        self._doubts_said.add(answer.doubt)
        name = self._ctx.redact(answer.provider or "") or "(unnamed provider)"
        counts = answer.usage.prompt_tokens or answer.usage.completion_tokens
        instead = ("its generation record's cost (checked the same way)" if ticket.gen else
                   "its token counts at the worst prices" if counts else f"its worst case ${ticket.worst:.6f}")
        self._ctx.event(ev.BadBill(line=f"{ds.config.name}: provider {name}: prompt "
                        f"{ticket.prompt_id!r} came with {answer.doubt}: not booked as given but at {instead}; the "
                        "answer is kept. Said once per kind; each such answer is counted as bad_bill",
                        dataset=ds.config.name))

    def _say(self, kind: EventKind, provider: str, payload: Callable[[str, int], ev.Payload]) -> None:
        """A provider's billing past what was asked: said the 1st, 10th, 100th... time per provider, as
        the payload `payload` makes of the provider's (redacted) name and the times so far."""
        name = self._ctx.redact(provider) or "(unnamed provider)"
        n = self._said[kind, name] = self._said.get((kind, name), 0) + 1
        if n == 1 or (n % 10 == 0 and str(n).rstrip("0") == "1"):
            self._ctx.event(payload(name, n))

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

    def _failed(self, ds: DatasetRun, prompt_id: str, tries: int, e: RequestFailed, seq: int) -> Attempted:
        self._ctx.recent.mark_final(ds.config.name, prompt_id)
        return Attempted(Outcome.FAILED, tries, error=e, seq=seq)

    async def _back_off(self, ds: DatasetRun, tries: int, e: RequestFailed) -> Attempted | None:
        """Wait out a transient error and a slot for the retry; GIVEN_UP instead when the run stops, or is
        paused or held, meanwhile.

        A paused run sends nothing, retries included: each is an attempt the provider may bill. A request
        in flight at the pause finishes if its attempt out answers; one that must retry hands its prompt
        back (unrecorded, asked once the run goes on) instead of waiting with its slot, so what is in
        flight drains to nothing while the run is paused."""
        control = self._ctx.control
        if control.closed or not control.is_open:
            return Attempted(Outcome.GIVEN_UP, tries - 1, error=e)
        self.retries += 1
        self.backing_off += 1
        try:
            eng = self._ctx.config.engine
            delay = backoff_delay(min(tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after, self._rng)
            # A drain or stop ends the wait at once (the prompt is given up below): a backoff of up to
            # backoff_max_s must not hold a drained run's exit.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(control.wait_closed(), delay)
        finally:
            self.backing_off -= 1
            self.last_transient = e
        if control.closed or not control.is_open:
            return Attempted(Outcome.GIVEN_UP, tries, error=e)
        await self._room.retry_slot(ds)
        if control.closed or not control.is_open:  # a drain, stop or pause while it waited for a slot
            return Attempted(Outcome.GIVEN_UP, tries, error=e)
        return None

    # -- 4. book, 5. record --------------------------------------------------------------------------

    def _book_outcome(self, req: Request, done: Attempted, body: dict[str, Any]) -> bool:
        """The outcome recorded (or the prompt handed back, skipped, its dataset stopped) and its source
        told; True when a record was written (it is fsynced before the request ends)."""
        ctx, ds, prompt = self._ctx, req.ds, req.prompt
        outcome = done.outcome
        if outcome is Outcome.ANSWERED:
            answer = done.answer
            assert answer is not None
            ctx.provider_stats.answer(answer.server or answer.provider or "unknown", answer.latency_s,
                                      answer.usage.completion_tokens)
            self._book.record_answer(ds, prompt, answer, done.attempts, done.seq,
                                     sampling=sampling_of(body) if ds.config.records_sampling else None)
            if answer.token_ids is None and self._wants_ids:
                self._no_ids(ds)
            if self.duplicates is not None:
                self.duplicates.answered(ds.config.name, prompt.id)
            req.book(Booked.answered(answer))
            return True
        if outcome is Outcome.FAILED:
            assert done.error is not None
            self._book.fail_or_doubt(ds, prompt, done.error, done.attempts, done.seq)
            req.book(Booked.failed(str(done.error.kind)))
            return True
        if outcome is Outcome.OVER_BUDGET:  # stays eligible: the next run (a higher max_usd) asks it again
            reason = "max_usd leaves no room for its retry"
            self._room.skip_for_money(ds, prompt.id, reason)
            req.book(Booked.skipped(reason))
            return False
        req.book(HANDED_BACK)  # not recorded, not its fault: it stays eligible
        if outcome is Outcome.ACCOUNT:
            assert done.error is not None
            self._watch.refused(done.error)
        elif outcome is Outcome.UNSENT:
            ctx.control.hold(Hold.DISK, f"{done.disk_error}. The run is paused: a request is only sent once the "
                             "spend ledger has it on disk; free space and press r to resume (headless: kill -USR1 "
                             "<pid>).")
        elif outcome is Outcome.DATASET:
            assert done.error is not None
            if ds.stop_for(done.error, ctx.redact):
                ctx.event(ev.DatasetStopped(cause=ds.message, dataset=ds.config.name))
        return False  # GIVEN_UP: a drain or stop while retrying

    # -- the self-hosted server's token ids ---------------------------------------------------------

    async def server_ids(self) -> None:
        """Which server and release answer (asked once, if the start-up check did not), and an event
        saying how its ids are asked in this run's mode, or why they cannot be."""
        if not self._wants_ids:
            return
        config = self._ctx.config
        if not config.api.server.asked:
            await detect_server(config, self.client)
        asked, text = ids_plan(config.api.server.release, config.api.base_url, config.api.streams)
        self._ids_said = not asked  # the reason is said once, here: each answer without ids is still counted
        self._ctx.event(ev.ServerIds(line=text, at=Level.INFO if asked else Level.WARN))

    def _no_ids(self, ds: DatasetRun) -> None:
        """An answer without the ids asked for: counted (no_ids), and said once with the fix."""
        self._ctx.errors.add(ErrorKind.NO_IDS)
        if not self._ids_said:
            self._ids_said = True
            api = self._ctx.config.api
            self._ctx.event(ev.ServerIds(line=missing_ids_message(api.server.release, api.base_url, api.streams),
            dataset=ds.config.name))

    # -- outages ------------------------------------------------------------------------------------

    def stalled(self, in_flight: int) -> str:
        """Why no answer comes while the run goes, in a sentence (empty when answers come)."""
        since = self._unreachable_since
        base_url = self._ctx.config.api.base_url
        if since is not None:
            cause = self.unreachable_cause or f"{base_url} does not answer"
            return (f"{cause} for {self._ctx.clock() - since:.0f} s; retrying until it answers "
                    f"({unreachable_advice(base_url, cause)}), no prompt is failed meanwhile")
        last = self.last_transient
        if self.backing_off and self.backing_off >= in_flight and last is not None:
            wait = f", Retry-After {last.retry_after:g} s" if last.retry_after is not None else ""
            return (f"all {self.backing_off} requests in flight are backing off a transient error "
                    f"({last.kind}{wait}): {self._ctx.redact(last.message)[:120]}")
        return ""

    def _note_unreachable(self, e: RequestFailed) -> None:
        ctx = self._ctx
        self.unreachable_cause = ctx.redact(e.message)[:200]
        if self._unreachable_since is None:
            self._unreachable_since = ctx.clock()
            # The cause once (it names the address), the advice that matches it, then what the run does.
            cause = self.unreachable_cause
            advice = unreachable_advice(ctx.config.api.base_url, cause, ctx.config.path)
            ctx.event(ev.Unreachable(line=f"{cause}: {advice}; retrying until it answers, no prompt "
                      "is failed meanwhile"))

    def _note_reachable(self, since: float) -> None:
        """The API answers again after it could not be reached since `since`."""
        ctx = self._ctx
        ctx.event(ev.Reachable(line=f"{ctx.config.api.base_url} answers again after "
                  f"{ctx.clock() - since:.0f} s out of reach"))
        self._unreachable_since = None

