"""Admission: which prompt goes out, and when.

Per dataset an admission loop streams the prompt file (ids already on disk skipped), puts the
prompts handed back (an account condition) in front, and admits a request when the run is not paused, a
concurrency slot is free under the adaptive limit and the budgets allow it; right before a request
starts, a prompt another dataset answered or is answering is skipped instead (duplicates.py). Each
request reserves the worst case of the very body it sends; a prompt whose worst case would not fit
under max_usd even with nothing in flight is skipped (counted, eligible later) and the next go on. The
limit adapts (AIMD) to sustained 429s; a retry over a lowered limit waits for a slot holding none.
Whether one more request (or retry) fits now is room.py's to say; this module decides which prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.loop.conversations import ConversationSource
from draftgen.core.generate.loop.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.request import Request
from draftgen.core.generate.loop.room import BodyFor, Decision, Room, Verdict
from draftgen.core.generate.loop.source import HANDED_BACK, TAKEN_ELSEWHERE, Booked, PromptSource, open_source
from draftgen.core.generate.money.budget import MoneyBudget
from draftgen.core.generate.money.spend import Ticket
from draftgen.core.live.snapshot import DatasetStatus, EventKind, EventSink, Level
from draftgen.core.units import usd

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun
    from draftgen.core.generate.loop.record_book import RecordBook
    from draftgen.core.generate.loop.run_state import RunControl

ADMIT_BURST = 64  # admissions between yields to the event loop (2,000 at once would stall it)


class AdaptiveConcurrency:
    """AIMD on sustained 429s: three or more within 2 s that are also at least 5% of the responses
    in those 2 s cut the limit by 30% (at most every 2 s) — a background trickle of 429s at a high
    request rate is not a storm; 5 s without a 429 lets it grow back by 2% of the configured value
    per second."""

    WINDOW_S = 2.0
    MIN_429 = 3
    MIN_SHARE = 0.05

    def __init__(self, configured: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = configured
        self.effective = float(configured)
        self._clock = clock
        self._recent: deque[float] = deque()      # times of 429s in the window
        self._responses: deque[float] = deque()   # times of every response in the window
        self._last_cut = -1e9
        self._last_429 = -1e9

    @property
    def limit(self) -> int:
        return max(1, int(self.effective))

    def _prune(self, now: float) -> None:
        for q in (self._recent, self._responses):
            while q and now - q[0] >= self.WINDOW_S:
                q.popleft()

    def on_response(self) -> None:
        """Any answer or error other than a 429 (the share's denominator)."""
        now = self._clock()
        self._responses.append(now)
        if len(self._responses) > 4096:
            self._prune(now)

    def on_429(self) -> None:
        now = self._clock()
        self._last_429 = now
        self._recent.append(now)
        self._responses.append(now)
        self._prune(now)
        share = len(self._recent) / len(self._responses)
        if len(self._recent) >= self.MIN_429 and share >= self.MIN_SHARE and now - self._last_cut >= 2.0:
            self.effective = max(1.0, self.effective * 0.7)
            self._last_cut = now
            self._recent.clear()

    def tick(self) -> bool:
        """Called every second; True when the limit grew."""
        now = self._clock()
        if self.effective < self.configured and now - self._last_429 >= 5.0:
            self.effective = min(float(self.configured), self.effective + max(1.0, self.configured * 0.02))
            return True
        return False


class Admission:
    """Admits the prompts of every dataset and keeps track of the requests it started."""

    def __init__(self, datasets: dict[str, DatasetRun], money: MoneyBudget, gate: RunControl, book: RecordBook,
                 request: Callable[[Request, Ticket, dict[str, Any]], Coroutine[Any, Any, None]],
                 on_event: EventSink, on_floor: Callable[[str], None], settling: Callable[[], int] = lambda: 0,
                 *, body: BodyFor, prices: dict[str, Prices | None],
                 duplicates: CrossDatasetDuplicates | None, self_hosted: bool = False) -> None:
        self._datasets = datasets
        self._room = Room(money, gate, book, in_flight=lambda: self.in_flight, on_event=on_event,
                          on_floor=on_floor, settling=settling, body=body, prices=prices)
        self._money = money
        self._gate = gate
        self._book = book
        self._request = request
        self._event = on_event
        self._self_hosted = self_hosted  # a conversation's history is sent as the API in use documents it
        self.tasks: set[asyncio.Task[None]] = set()
        self.duplicates = duplicates  # None: off, or only one dataset

    @property
    def in_flight(self) -> int:
        return sum(d.in_flight for d in self._datasets.values())

    def wake_all(self) -> None:
        for d in self._datasets.values():
            d.wake.set()

    async def run(self, ds: DatasetRun) -> None:
        """Admit the dataset's prompts until its source has none left (or a budget, drain or stop ends
        it), then wait for its requests in flight; leaves the dataset's final status."""
        if self._gate.closed:
            return
        await self._open(ds)
        budget_reason = await self._admit_all(ds, self._source(ds))
        while ds.in_flight:
            ds.wake.clear()
            await ds.wake.wait()
        self._end(ds, budget_reason)

    def _source(self, ds: DatasetRun) -> PromptSource:
        """The dataset's prompt source: its conversations turn by turn (turns = "all"), else its file."""
        if ds.config.turns == "all":
            rd = self._book.rundir
            return ConversationSource(ds, self_hosted=self._self_hosted, responses=rd.responses(ds.config.name),
                                      failures=rd.failures(ds.config.name), on_event=self._event)
        return open_source(ds, self._book)

    async def _open(self, ds: DatasetRun) -> None:
        """Count the dataset's prompt file (if the run's opening could not), say it starts."""
        name = ds.config.name
        if not ds.scanned:
            await asyncio.to_thread(self._book.scan_prompts, ds)
        ds.running()
        if ds.rejected:
            self._event(Level.WARN, EventKind.REJECTED, f"{name}: {ds.rejected} prompt lines rejected "
                        f"(see {self._book.rundir.rejected(name)})", dataset=name)
        units = (f"turns of {ds.conversations.total} conversations (turns = \"all\")" if ds.config.turns == "all"
                 else "prompts")
        self._event(Level.INFO, EventKind.DATASET_START, f"{name}: {ds.total} {units}, {ds.done} already answered, "
                    f"{ds.failed} already failed; concurrency {ds.config.concurrency}", dataset=name)

    async def _admit_all(self, ds: DatasetRun, source: PromptSource) -> str:
        """Every prompt of the source admitted, skipped or handed back, until it has none left or a drain,
        stop or stopped dataset halts admission; returns the budget that ended the dataset ('' if none).
        Once a budget ends it, the source's prompts are counted skipped as they come."""
        budget_reason = ""
        admitted = 0
        while (prompt := await source.next()) is not None:
            if budget_reason:
                ds.skipped_some()
                source.booked(prompt, Booked.skipped(budget_reason))
                continue
            body, worst = self.request_for(ds, prompt)
            decision = await self.admit(ds, worst)
            if decision.verdict is Verdict.GO:
                if self._taken_elsewhere(ds, prompt):
                    source.booked(prompt, TAKEN_ELSEWHERE)
                    continue
                self._start(ds, prompt, body, worst, source)
                admitted += 1
                if admitted % ADMIT_BURST == 0:
                    await asyncio.sleep(0)  # let answers and the UI run between bursts of admissions
            elif decision.verdict is Verdict.HALT:
                source.booked(prompt, HANDED_BACK)
                break
            elif decision.verdict is Verdict.SKIP:
                self.skip_for_money(ds, prompt.id, decision.reason)
                source.booked(prompt, Booked.skipped(decision.reason))
            else:
                budget_reason = decision.reason
                ds.skipped_some()
                source.booked(prompt, Booked.skipped(budget_reason))
                self._budget_ends(ds, decision)
        return budget_reason

    def _budget_ends(self, ds: DatasetRun, decision: Decision) -> None:
        """A budget ends the dataset: the rest of its prompts is skipped (eligible for a later run)."""
        name = ds.config.name
        if decision.money:
            self._room.stop_for_money(name)
        ds.end(DatasetStatus.BUDGET, decision.reason)
        self._event(Level.WARN, EventKind.BUDGET, f"{name}: {decision.reason}; the rest is skipped "
                    "(stays eligible for a later run)", dataset=name)

    def _end(self, ds: DatasetRun, budget_reason: str) -> None:
        """Nothing left in flight: settle the set-aside prompts, leave the dataset's final status, say it."""
        name = ds.config.name
        if not self._gate.closed and not budget_reason and self._book.settle_doubts(ds):
            self._event(Level.ERROR, EventKind.DATASET_STOPPED, f"{name}: {ds.message}", dataset=name)
        if ds.stopped:
            ds.end(DatasetStatus.STOPPED)
        elif budget_reason:
            ds.end(DatasetStatus.BUDGET)
        elif self._gate.closed:
            ds.end(DatasetStatus.STOPPED, ds.message or "stopped before the end; the next run resumes")
        elif self.money_skipped.get(name):
            ds.end(DatasetStatus.BUDGET, f"max_usd: {self.money_skipped[name]} prompts skipped, their worst case "
                   "above what max_usd leaves (they stay eligible for a later run)")
        else:
            ds.end(DatasetStatus.DONE)
        duplicates = self.duplicates.skipped.get(name, 0) if self.duplicates is not None else 0
        costly = self.money_skipped.get(name, 0)
        self._event(Level.INFO, EventKind.DATASET_DONE, f"{name}: {ds.status}: {ds.done}/{ds.total} answered, "
                    f"{ds.failed} failed, {ds.skipped} skipped"
                    f"{f' ({costly} by max_usd)' if costly else ''}"
                    f"{f' ({duplicates} already answered in another dataset)' if duplicates else ''}, "
                    f"{usd(self._money.spend.by_dataset.get(name, ds.cost))}"  # the ledger's, as in the panel
                    f"{_conversations_done(ds)}", dataset=name)

    def _taken_elsewhere(self, ds: DatasetRun, prompt: Prompt) -> bool:
        """Skip (counted, and said once per dataset) a prompt another dataset answered or is answering;
        otherwise the prompt is this dataset's while it is in flight (core/generate/loop/duplicates.py)."""
        if self.duplicates is None:
            return False
        other = self.duplicates.claim(ds.config.name, prompt.id, prompt.messages,
                                      turn=ds.config.turns == "all")
        if other is None:
            return False
        ds.skipped_some()
        if self.duplicates.skip(ds.config.name) == 1:
            self._event(Level.WARN, EventKind.DUPLICATE,
                        f"{ds.config.name}: prompt {prompt.id!r} skipped: the same prompt "
                        f"(normalised text) is already answered in {other}; every such prompt is skipped and "
                        f"counted ([engine] skip_cross_dataset_duplicates = false sends them)", dataset=ds.config.name)
        return True

    # -- room for one more request (room.py), under the names the engine and the watch use ------

    @property
    def prices(self) -> dict[str, Prices | None]:
        """Each dataset's prices (None: unknown): what a request's worst case is reckoned from."""
        return self._room.prices

    @property
    def last_worst(self) -> float:
        """The worst case of the last request asked for: what a re-check must find room for."""
        return self._room.last_worst

    @property
    def money_skipped(self) -> dict[str, int]:
        """Prompts skipped because their worst case did not fit what max_usd left, per dataset."""
        return self._room.money_skipped

    @property
    def money_limited(self) -> bool:
        """max_usd left some prompt unasked this run (skipped, eligible for a later run)."""
        return self._room.money_limited

    def request_for(self, ds: DatasetRun, prompt: Prompt) -> tuple[dict[str, Any], float]:
        """The body this prompt's request sends, and the worst case of sending it (Room.request_for)."""
        return self._room.request_for(ds, prompt)

    def skip_for_money(self, ds: DatasetRun, prompt_id: str, reason: str) -> None:
        """Skip one prompt max_usd has no room for: counted, eligible later (Room.skip_for_money)."""
        self._room.skip_for_money(ds, prompt_id, reason)

    async def admit(self, ds: DatasetRun, worst: float) -> Decision:
        """Wait until the dataset may send one more request costing at most `worst` (Room.admit)."""
        return await self._room.admit(ds, worst)

    async def reserve_retry(self, ds: DatasetRun, prompt_id: str, worst: float) -> Ticket | None:
        """A new reservation for a retry, or None when nothing can free room (Room.reserve_retry)."""
        return await self._room.reserve_retry(ds, prompt_id, worst)

    async def retry_slot(self, ds: DatasetRun) -> None:
        """Wait, holding no slot, while the dataset is over its concurrency limit (Room.retry_slot)."""
        await self._room.retry_slot(ds)

    def _start(self, ds: DatasetRun, prompt: Prompt, body: dict[str, Any], worst: float,
               source: PromptSource) -> None:
        expected_tokens = ds.tokens.expected()
        probe = ds.doubts.held  # doubts.py: while held, one request at a time
        if probe:
            ds.doubts.probe_out = True
        ticket = self._money.spend.reserve(ds.config.name, prompt.id, worst)
        ds.request_started()
        ds.tokens.in_flight += expected_tokens
        req = Request(ds, prompt, source)
        task = asyncio.create_task(self._request(req, ticket, body))
        self.tasks.add(task)

        # A done-callback, not a `finally`: a task cancelled before its first step never runs its body.
        def finished(t: asyncio.Task[None]) -> None:
            self.tasks.discard(t)
            ds.request_ended()
            ds.tokens.in_flight -= expected_tokens
            self._money.spend.release(ticket)  # cancelled before it was sent: nothing to settle
            req.book(HANDED_BACK)  # cancelled (stop now) before its outcome was booked: it stays eligible
            if probe:
                ds.doubts.probe_out = False
            if self.duplicates is not None:
                self.duplicates.settled(ds.config.name, prompt.id)
            if len(self._datasets) == 1:
                ds.wake.set()
            else:
                self.wake_all()
        task.add_done_callback(finished)

    async def grow_limits(self) -> None:
        """Every second: let the limits cut by 429s grow back (runs for the life of the run)."""
        while True:
            await asyncio.sleep(1.0)
            for ds in self._datasets.values():
                if ds.concurrency.tick():
                    ds.wake.set()



def _conversations_done(ds: DatasetRun) -> str:
    """A turns = "all" dataset's conversations, for its dataset_done line ("" for a single-turn one)."""
    if ds.config.turns != "all":
        return ""
    c = ds.conversations
    why = ", ".join(f"{n} {kind}" for kind, n in c.reasons.most_common())
    return (f" (turns; conversations: {c.done}/{c.total} done, {c.ended} ended early{f': {why}' if why else ''})")
