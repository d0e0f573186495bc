"""One request, from its admission to its record, in this one file.

A request is one `Request` object: it carries its body, its reservation (a `Ticket`, one per
attempt), its attempts and the evidence its retries are weighed against, its outcome and what it
holds until it ends. A request coroutine of its dataset (admission.py) pulls a prompt from the
dataset's source (source.py), builds its `Request` and, under the dataset's admission lock, admits it
(`Request.admit_now`, or `Request.admit` when it must wait for room); then `Request.run` takes it to
its record, in order:

1. admit (`admit_now`, `admit`, `admitted`): the body this prompt's request sends and the worst case
   of that very body; room for it (room.py: the gate, the dataset's doubts, token budget, max_usd and
   credit floor, its concurrency); a prompt another dataset answered or is answering is skipped instead (duplicates.py);
2. reserve: that worst case on the spend ledger (a `Ticket`), the request in flight in its dataset;
3. attempt and retry (`attempts`): each attempt on the ledger before it leaves, booked as it ends
   (billing.py); transient errors retried with backoff under a new reservation each (room.py:
   `reserve_retry`, `retry_slot`), for as long as an outage lasts;
4. book (`Terms.book`): the outcome, decided by whose problem the last response was (classify.py);
5. record: an answer or failure line through the record book (record_book.py), fsynced before the
   request ends; the source told what became of the prompt (`Booked`), once; what it held released.

What differs between a run's request and a smoke test's is its `Terms` (how an attempt is reserved,
what a failure does, how an answer and the outcome are booked): `RunTerms` here, one per run; the smoke
test's (smoke_request.py) runs the same `attempts` on its own ledger and books the outcome as its
checklist row's answer or reason. What the service did for every request of the run (answers, answer
faults, outages, what was said once) is the run's `Service` (service.py).

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

What a request holds (its slot, its reservation, its tokens in flight, its dataset's probe, its claim
on the prompt against other datasets) is released in a `finally` as it ends, however it ends. A
request whose outcome was never booked is booked there: HANDED_BACK when it was cancelled (stop now),
FAILED (for its source only: nothing is written) when it ended on an error of the engine's own, which
asking it again would only repeat; either way it stays eligible for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from draftgen.core.bodies import ChatBody
from draftgen.core.config_tables import sampling_of
from draftgen.core.errors import DiskError
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import ANSWER_KINDS, Whose
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.parts import RunParts
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.room import VERDICT_GO, Admit, Decision, Room
from draftgen.core.generate.loop.run_state import Hold
from draftgen.core.generate.loop.service import ANSWER_BLOCK_BITS, Service, backoff_delay
from draftgen.core.generate.loop.source import HANDED_BACK, TAKEN_ELSEWHERE, Booked, BookedAs, PromptSource
from draftgen.core.generate.money.billing import believed, book_answered, book_failure, look_up
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger, Ticket
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventKind
from draftgen.core.records import ErrorKind

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun
    from draftgen.core.generate.loop.watch import AccountWatch

ENDED_ON_ERROR = Booked.failed("its request ended on an error of the engine's own")
TAKEN = Decision(Admit.SKIP, "another dataset has the prompt")  # skipped, counted as such (no money)


class Outcome(Enum):
    ANSWERED = "answered"    # record the answer
    FAILED = "failed"        # failed for a reason of its own: record the failure
    ACCOUNT = "account"      # the key or the account: hand the prompt back, stop admission run-wide
    DATASET = "dataset"      # the dataset's routing or settings: stop the dataset, the prompt stays eligible
    GIVEN_UP = "given_up"    # drained, or paused, while retrying: not recorded, stays eligible
    OVER_BUDGET = "over_budget"  # max_usd leaves no room for a retry: not recorded, counted skipped
    UNSENT = "unsent"        # the disk refused the spend ledger's line: not sent, handed back


class Terms(Protocol):
    """What differs between a run's request and a smoke test's, for `Request.attempts`."""
    spend: SpendLedger
    settler: Settler | None
    client: ChatClient
    bills_answers: bool  # whether a failure may be billed, and looked up (the server kind's: billing.py)

    def prices(self, req: Request) -> Prices | None: ...

    async def reserve(self, req: Request) -> Outcome | None:
        """`req.ticket` reserved for the next attempt and on the ledger as sent (None), or why not."""

    async def failed(self, req: Request, e: RequestFailed) -> Outcome | None:
        """What an attempt's failure (already booked) ends the request with; None: try again."""

    def answered(self, req: Request, answer: ChatAnswer) -> Outcome:
        """The answer booked on the ledger (`req.answer`): ANSWERED."""

    async def book(self, req: Request, outcome: Outcome) -> None:
        """The request's outcome booked: a run's recorded (durable before it returns) or its prompt handed
        back, skipped or its dataset stopped, its source told; a smoke test's its answer or why it failed."""


class Request:
    """One prompt asked: its body, its reservation, its attempts, its outcome, and what it holds."""
    __slots__ = ("terms", "ds", "prompt", "source", "body", "worst", "ticket", "expected", "probe", "booked", "tries",
                 "spent", "seq", "sent_no", "sent_at", "first_block", "faults_before", "own_faults", "answer",
                 "error", "disk_error", "why")

    def __init__(self, terms: Terms, prompt: Prompt, ds: DatasetRun | None = None, source: PromptSource | None = None,
                 body: ChatBody | None = None) -> None:
        self.terms = terms
        self.prompt = prompt
        self.ds = ds              # the run's dataset (None: a smoke test's request)
        self.source = source      # told what became of the prompt, once (None: a smoke test's)
        self.body: ChatBody = body or {}
        self.worst = 0.0          # the worst case of `body` (admit_now): what its first attempt reserves
        self.ticket: Ticket | None = None  # the attempt's reservation (the first one's released as it ends)
        self.expected = 0         # its tokens counted in flight against the dataset's token budget
        self.probe = False        # the one request of a dataset held by its doubts (doubts.py)
        self.booked = False
        self.tries = 0            # requests sent
        self.spent = 0            # attempts that count against max_attempts
        self.seq = 0              # the dataset's count of requests sent when the last one left (DatasetRun.sent)
        self.sent_no = 0          # the run's count of requests sent when the last one left (Service.sent)
        self.sent_at = 0.0        # when the last one left (the dataset's concurrency clock)
        self.first_block = 0      # the block of sends after its first: the answers it is weighed against
        self.faults_before = 0    # the run's answer faults before its first try
        self.own_faults = 0       # its own answer faults
        self.answer: ChatAnswer | None = None
        self.error: RequestFailed | None = None
        self.disk_error: DiskError | None = None
        self.why = ""             # why a smoke test's request was not sent

    # -- 1. admit, 2. reserve ------------------------------------------------------------------------

    def admit_now(self) -> Decision | None:
        """The body this prompt's request sends and its worst case made, and the prompt admitted if room
        for it is decided now (`admitted`); None when it must wait for room (then `admit`). A prompt is
        decided here almost always: no coroutine is made for it."""
        terms = self.terms
        assert isinstance(terms, RunTerms) and self.ds is not None
        room = terms.room
        self.body, self.worst = room.request_for(self.ds, self.prompt)
        decision = room.admit_now(self.ds, self.worst)
        return None if decision is None else self.admitted(decision)

    async def admit(self) -> Decision:
        """Wait for room for the prompt's request (`admit_now` returned None) and admit it (`admitted`)."""
        terms, source = self.terms, self.source
        assert isinstance(terms, RunTerms) and self.ds is not None and source is not None
        try:
            decision = await terms.room.admit(self.ds, self.worst)
        except asyncio.CancelledError:  # the run cancelled while it waited: the prompt stays eligible
            source.booked(self.prompt, HANDED_BACK)
            raise
        return self.admitted(decision)

    def admitted(self, decision: Decision) -> Decision:
        """The prompt admitted (GO: `run` it next), or skipped (SKIP: max_usd has no room for it; a GO whose
        prompt another dataset has is skipped too, as SKIP), or given back to its source (HALT); BUDGET
        leaves it with the caller, whose dataset the budget ends."""
        terms, ds, prompt, source = self.terms, self.ds, self.prompt, self.source
        assert isinstance(terms, RunTerms) and ds is not None and source is not None
        verdict = decision.verdict
        if verdict is VERDICT_GO:  # Admit.GO (room.py says why it is read so)
            if terms.duplicates is None or not terms.taken_elsewhere(ds, prompt):  # no call without duplicates
                self.ticket = terms.spend.reserve(ds.config.name, prompt.id, self.worst)
                self.expected = expected = ds.token_budget.expected()
                # doubts.py: while held, one request at a time (`held` not asked while nothing is set aside)
                self.probe = probe = doubts.held if (doubts := ds.doubts).items else False
                ds.request_started(expected, probe=probe)
                return decision
            source.booked(prompt, TAKEN_ELSEWHERE)
            return TAKEN
        if verdict is Admit.HALT:
            source.booked(prompt, HANDED_BACK)
        elif verdict is Admit.SKIP:
            terms.room.skip_for_money(ds, prompt.id, decision.reason)
            source.booked(prompt, Booked.skipped(decision.reason))
        return decision

    async def run(self, task: asyncio.Task[None]) -> None:
        """The admitted request asked until it has an outcome (under the body its ticket reserved for), the
        outcome booked and recorded, durable (group fsync) before it ends; what it held is released as it
        ends, however it ends (a stop now cancels it: its prompt is handed back). `task`: the one running
        it (its dataset's request coroutine, admission.py), what a stop now cancels."""
        terms, ds, first = self.terms, self.ds, self.ticket
        assert isinstance(terms, RunTerms) and ds is not None and first is not None
        tasks = terms.service.tasks
        tasks.add(task)
        try:
            await terms.book(self, await self.attempts())
        except Exception as exc:  # an error of the engine's own: not asked again this run, said with its cause
            if not self.booked:
                self.tell(ENDED_ON_ERROR)
                terms.ctx.event(ev.RequestError(prompt_id=self.prompt.id, cause=f"{type(exc).__name__}: {exc}",
                                                dataset=ds.config.name))
        finally:
            tasks.discard(task)
            # What it held, released; its dataset (or, money being shared, every dataset) woken.
            ds.request_ended(self.expected, probe=self.probe)
            terms.spend.release(first)  # never sent: nothing to settle
            if not self.booked:  # its outcome never decided (stop now cancelled it): stays eligible
                self.tell(HANDED_BACK)
            if (duplicates := terms.duplicates) is not None:
                duplicates.settled(ds.config.name, self.prompt.id)
            terms.wake(ds)

    # -- 3. attempt and retry ------------------------------------------------------------------------

    async def attempts(self) -> Outcome:
        """Ask until there is an outcome. Each attempt goes out under its own reservation (the admitted one
        first), on the spend ledger before it leaves, and is booked as it ends (billing.py): answered at
        its usage.cost, refused (nothing billed), or pending until the settler prices it."""
        terms = self.terms
        spend, settler = terms.spend, terms.settler
        details = self.ds is None or self.ds.config.turns == "all"  # reasoning passed back next turn
        while True:
            ended = await terms.reserve(self)
            if ended is not None:
                return ended
            ticket = self.ticket
            assert ticket is not None
            self.tries += 1
            try:
                answer = await terms.client.chat(self.body, functools.partial(spend.generation, ticket),
                                                 details=details)
            except RequestFailed as e:
                look_up(settler, book_failure(spend, ticket, e, terms.prices(self),
                                              bills_answers=terms.bills_answers, body=self.body))
                ended = await terms.failed(self, e)
                if ended is not None:
                    return ended
                continue
            except BaseException:  # stop-now (a cancel) mid-request: the provider may bill it anyway
                look_up(settler, spend.abandoned(ticket))
                raise
            return terms.answered(self, believed(answer, ticket, terms.prices(self), self.body))

    # -- 4. book, 5. record --------------------------------------------------------------------------

    def tell(self, result: Booked) -> None:
        """Tell the source what became of the prompt (the first outcome booked is the one)."""
        if not self.booked:
            self.booked = True
            assert self.source is not None
            self.source.booked(self.prompt, result)


class RunTerms:
    """A run's terms for its requests (one per run, built by run_loop.py): its parts, its room and
    account watch, and the service's run-wide counts."""
    __slots__ = ("ctx", "parts", "room", "watch", "service", "spend", "settler", "client", "bills_answers",
                 "duplicates", "_datasets", "_prices")

    def __init__(self, ctx: RunContext, parts: RunParts, room: Room, watch: AccountWatch, service: Service) -> None:
        self.ctx = ctx
        self.parts = parts
        self.room = room
        self.watch = watch
        self.service = service
        self.spend = parts.spend
        self.settler: Settler | None = parts.opened.costs.settler
        self.client = parts.opened.client
        self.bills_answers = ctx.config.api.server.kind.bills_answers
        self.duplicates = parts.opened.duplicates  # claims against the other datasets (None: a single dataset's)
        self._datasets = tuple(parts.datasets.values())  # woken as a request ends (`wake`)
        self._prices = parts.opened.costs.prices  # per dataset, as the run finds them (read at each answer)

    def prices(self, req: Request) -> Prices | None:
        assert req.ds is not None
        return self._prices.get(req.ds.config.name)

    def taken_elsewhere(self, ds: DatasetRun, prompt: Prompt) -> bool:
        """Skip (counted, and said once per dataset) a prompt another dataset answered or is answering;
        otherwise the prompt is this dataset's while it is in flight (core/generate/loop/duplicates.py)."""
        duplicates = self.duplicates
        if duplicates is None:
            return False
        other = duplicates.claim(ds.config.name, prompt.id, prompt.messages, turn=ds.config.turns == "all")
        if other is None:
            return False
        ds.skipped_some()
        if duplicates.skip(ds.config.name) == 1:
            self.ctx.event(ev.Duplicate(prompt_id=prompt.id, other=other, dataset=ds.config.name))
        return True

    def wake(self, ds: DatasetRun) -> None:
        """A request of `ds` ended: its dataset (or, money being shared, every dataset) woken."""
        datasets = self._datasets
        if len(datasets) == 1:
            ds.wake.set()
        else:
            for d in datasets:
                d.wake.set()

    async def reserve(self, req: Request) -> Outcome | None:
        ds, ticket, spend, control = req.ds, req.ticket, self.spend, self.ctx.control
        assert ds is not None and ticket is not None
        if not req.tries:  # its first try: what the service did for the others from here on is its evidence
            service = self.service
            req.first_block, req.faults_before = (service.sent >> ANSWER_BLOCK_BITS) + 1, service.answer_faults
        elif not ticket.open:  # a retry: the last reservation is settled or pending
            renewed = await self.room.reserve_retry(ds, ticket.prompt_id, ticket.worst)
            if renewed is None:
                return Outcome.GIVEN_UP if control.closed else Outcome.OVER_BUDGET
            req.ticket = ticket = renewed
        try:
            await spend.send_grouped(ticket)  # durable (one fsync per batch) before the request leaves
        except DiskError as e:
            spend.release(ticket)
            req.disk_error = e
            return Outcome.UNSENT
        if not control.is_open:
            # Paused or held (an account's 402) while its sent line was made durable: it has not left,
            # so it does not, a retry no more than a first attempt (a drain lets what it admitted go
            # out and finish); the ledger says so (refused, nothing billed) and the prompt is handed
            # back, asked once the run goes on.
            spend.refused(ticket)
            return Outcome.GIVEN_UP
        req.seq = ds.note_sent()
        req.sent_at = ds.concurrency.on_send()
        service = self.service
        req.sent_no = sent = service.sent
        service.sent = sent + 1
        return None

    async def failed(self, req: Request, e: RequestFailed) -> Outcome | None:
        """A failed attempt in the error tallies and fed to the dataset's concurrency; its outcome when it is
        the account's, the dataset's or the prompt's own (no retry helps), else the wait before its retry."""
        ctx, ds, ticket, service = self.ctx, req.ds, req.ticket, self.service
        assert ds is not None and ticket is not None
        if e.past_cap is not None:
            service.say(EventKind.PAST_CAP, e.provider, lambda who, n: ev.ProviderPastCap(
                provider=who, times=n, prompt_id=ticket.prompt_id, cause=e.message, dataset=ds.config.name))
        ctx.errors.add(e.kind)
        ctx.recent.add(kind=str(e.kind), dataset=ds.config.name, prompt_id=ticket.prompt_id, attempt=req.tries,
                       message=ctx.redact(e.message), status=e.status, provider=e.server or e.provider)
        # a fleet's server's own limit took it, not the dataset's
        if e.slows_down(ctx.config.api.server.kind.full_at_503) and not e.fleet_limited:
            ds.concurrency.on_429(req.sent_at)
        req.error = e
        whose = e.whose
        if whose is Whose.ACCOUNT:
            return Outcome.ACCOUNT
        if whose is Whose.DATASET:
            return Outcome.DATASET
        if whose is Whose.PROMPT:
            return self._failed(req)
        if e.unreachable:
            service.note_unreachable(e)
        # An answer fault may be this prompt's; one coded as an outage (a 503 mid-stream) is not.
        if e.kind in ANSWER_KINDS and not e.outage:
            service.answer_faults += 1
            req.own_faults += 1
            if self._spends_attempt(req, e):
                req.spent += 1
                if req.spent >= ctx.config.engine.max_attempts:
                    return self._failed(req)
            if e.kind is ErrorKind.BAD_BODY and (broken := ds.unreadable(e)) is not None:
                req.error = broken
                return Outcome.DATASET  # the server's: it stops
        return await self._back_off(req, e)

    def _spends_attempt(self, req: Request, e: RequestFailed) -> bool:
        """An answer fault counts against the prompt only while the other prompts got more answers than
        faults since its first try, or while it is alone; an answer run past max_tokens was billed: it
        always counts (paid retries stay bounded)."""
        # Alone (nothing else of its dataset in flight, no other fault since its first try) there is no
        # other evidence: its own faults count, or a poison prompt at a dataset's end would be asked, and
        # paid for, forever.
        ds, service = req.ds, self.service
        assert ds is not None
        others_faults = service.answer_faults - req.faults_before - req.own_faults
        alone = ds.in_flight - ds.parked <= 1 and not others_faults
        return service.answered_since(req.first_block) > others_faults or alone or e.past_cap is not None

    def _failed(self, req: Request) -> Outcome:
        assert req.ds is not None
        self.ctx.recent.mark_final(req.ds.config.name, req.prompt.id)
        return Outcome.FAILED

    async def _back_off(self, req: Request, e: RequestFailed) -> Outcome | None:
        """Wait out a transient error and a slot for the retry; GIVEN_UP instead when the run stops, or is
        paused or held, meanwhile.

        A paused run sends nothing, retries included: each is an attempt the provider may bill. A request
        in flight at the pause finishes if its attempt out answers; one that must retry hands its prompt
        back (unrecorded, asked once the run goes on) instead of waiting with its slot, so what is in
        flight drains to nothing while the run is paused."""
        control, service, ds = self.ctx.control, self.service, req.ds
        assert ds is not None
        if control.closed or not control.is_open:
            return Outcome.GIVEN_UP
        service.retries += 1
        service.backing_off += 1
        try:
            eng = self.ctx.config.engine
            delay = backoff_delay(min(req.tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after,
                                  service.rng)
            # A drain or stop ends the wait at once (the prompt is given up below): a backoff of up to
            # backoff_max_s must not hold a drained run's exit. asyncio.timeout, not wait_for, which on
            # Python 3.11 swallows a cancel (stop now) that arrives as the wait ends (the stop closes the run
            # in the turn it cancels the requests).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await control.wait_closed()
        finally:
            service.backing_off -= 1
            service.last_transient = e
        if control.closed or not control.is_open:
            return Outcome.GIVEN_UP
        await self.room.retry_slot(ds)
        if control.closed or not control.is_open:  # a drain, stop or pause while it waited for a slot
            return Outcome.GIVEN_UP
        return None

    def answered(self, req: Request, answer: ChatAnswer) -> Outcome:
        """An answer booked on the ledger at what it billed (what of its bill is believed: billing.py), its
        bill held against the dataset's prices (trust.py), and counted as the service's evidence."""
        ds, ticket, service = req.ds, req.ticket, self.service
        assert ds is not None and ticket is not None
        name = ds.config.name
        if answer.doubt:
            service.doubted(name, ticket, answer)
        self.room.trust.billed(name, answer, ticket.prompt_id)
        # the record's cost is what the ledger booked (the dataset's prices as `prices` looks them up)
        answer, over = book_answered(self.spend, ticket, answer, self.parts.opened.costs.prices.get(name),
                                     self.settler)
        if over:
            service.say(EventKind.OVER_RESERVATION, answer.provider or "", lambda who, n: ev.OverReservation(
                provider=who, times=n, prompt_id=ticket.prompt_id, reserved_usd=ticket.worst,
                billed_usd=ticket.worst + over, dataset=name))
        service.note_answer(req.sent_no)
        req.answer = answer
        return Outcome.ANSWERED

    async def book(self, req: Request, outcome: Outcome) -> None:
        """The outcome recorded, durable (group fsync) before it returns, or the prompt handed back,
        skipped, its dataset stopped; its source told."""
        ds, prompt = req.ds, req.prompt
        assert ds is not None
        ctx, book = self.ctx, self.parts.book
        if outcome is Outcome.ANSWERED:
            answer = req.answer
            assert answer is not None
            ctx.provider_stats.answer(answer.server or answer.provider or "unknown", answer.latency_s,
                                      answer.usage.completion_tokens)
            book.record_answer(ds, prompt, answer, req.tries, req.seq,
                               sampling=sampling_of(req.body) if ds.config.records_sampling else None)
            if answer.token_ids is None and self.service.wants_ids:
                self.service.no_ids(ds.config.name)
            if (duplicates := self.parts.opened.duplicates) is not None:
                duplicates.answered(ds.config.name, prompt.id)
            req.tell(Booked(BookedAs.ANSWERED, answer))  # Booked.answered, without its call
            await book.synced(ds)
            return
        if outcome is Outcome.FAILED:
            assert req.error is not None
            book.fail_or_doubt(ds, prompt, req.error, req.tries, req.seq)
            req.tell(Booked.failed(str(req.error.kind)))
            await book.synced(ds)
            return
        if outcome is Outcome.OVER_BUDGET:  # stays eligible: the next run (a higher max_usd) asks it again
            reason = "max_usd leaves no room for its retry"
            self.room.skip_for_money(ds, prompt.id, reason)
            req.tell(Booked.skipped(reason))
            return
        req.tell(HANDED_BACK)  # not recorded, not its fault: it stays eligible
        if outcome is Outcome.ACCOUNT:
            assert req.error is not None
            self.watch.refused(req.error)
        elif outcome is Outcome.UNSENT:
            ctx.control.hold(Hold.DISK, f"{req.disk_error}. The run is paused: a request is only sent once the "
                             "spend ledger has it on disk; free space and press r to resume (headless: kill -USR1 "
                             "<pid>).")
        elif outcome is Outcome.DATASET:
            assert req.error is not None
            if ds.stop_for(req.error, ctx.redact):
                ctx.event(ev.DatasetStopped(cause=ds.message, dataset=ds.config.name))
        # GIVEN_UP (a drain or stop while retrying): handed back, nothing more
