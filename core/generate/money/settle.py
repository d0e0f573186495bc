"""Pricing abandoned generations from their records, in the background.

An attempt the client gave up on (a timeout, a dropped connection, stop-now, a run killed before
it read the answer) may still be billed: a non-streamed request runs on and is billed in full, an
aborted stream up to the abort. `GET /api/v1/generation?id=` returns the record (`total_cost`)
shortly after the generation ends, so a 404 is retried, with backoff, for `lookup_s`; what is still
not found then stays pending (at its worst case) for the next run or `draftgen ledger`, except the
id of a 500, 502 or 503 (`Pending.ended`): that error was answered at once, so no generation runs on,
and a record still missing after `lookup_s` of 404s (two at least) means none ran: it settles at $0
("no record"). A 408, 504 or 524 (someone gave up on a generation that may run on) stays pending.

A record's cost is checked as an answer's is (billing.py): one that is not a finite non-negative number,
or is past both ten times what the attempt counted at (its reservation or token estimate) and what a
generation run on past its cap is believed to cost at most (`RUN_ON_USD`, ~$105), is not believed: the
attempt settles at what it counted at ("worst case"), once, said by `on_doubt`, so a bad record neither
books a fortune nor leaves the attempt looked up run after run.

An attempt without a generation id (a run killed before its answer's headers, a request timed out
before them) is priced from the key's usage once it cannot still be running (unknown.py): a task
sleeps until the last of them is due (a killed run's were sent within moments of each other), reads
GET /key once, and settles them all ("key usage"); a read that fails is tried again a while later
(after a few failures they are left to the next run). Until they are priced they count at their
worst case, and `waiting` counts them, so a run that max_usd holds back only by them waits for them
rather than ending LIMITED (room.py).

An openai-compatible server (`[api] kind`) has no generation records and bills nothing: what is
pending there (a request lost when the server died, a run killed mid-request) is settled at once,
an answer without a cost at its token estimate, anything else at $0 ("self-hosted"), so no phantom
worst case holds `max_usd`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

import aiohttp

from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.money.billing import ABSURD_FACTOR, RUN_ON_USD
from draftgen.core.generate.money.spend import CostSource, Pending, SpendLedger
from draftgen.core.generate.money.unknown import due_unknown, settle_from_key
from draftgen.core.records import count_of

WORKERS = 8
KEY_RETRY_S = 30.0  # a GET /key that failed (or showed no usage) is tried again after this long
KEY_TRIES = 4       # ... and after this many failures the run leaves its unknown attempts at worst case
# The ledger's exact costs are taken this long (at most generation_lookup_s) before GET /key is read, so
# a charge the key's usage shows a little late is in it (unknown.py: they are subtracted from it).
KEY_LAG_S = 5.0


def record_cost(record: dict[str, object], worst: float) -> tuple[float | None, bool]:
    """A generation record's cost (`total_cost`, else `usage`) and whether it is believed: (None, True) when
    it has none; (the cost, False) when it is not a finite number from 0 to the larger of ABSURD_FACTOR x
    `worst` and RUN_ON_USD (a provider that ran on past the cap bills what it generated)."""
    raw = record.get("total_cost", record.get("usage"))
    if raw is None:
        return None, True
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        return 0.0, False
    try:
        cost = float(raw)
    except ValueError:
        return 0.0, False
    return cost, 0 <= cost <= max(ABSURD_FACTOR * worst, RUN_ON_USD)  # NaN: False


class Settler:
    def __init__(self, spend: SpendLedger, client: ChatClient, lookup_s: float,
                 on_settled: Callable[[], None] = lambda: None, *, bills_answers: bool = True,
                 on_over: Callable[[Pending, float, str], None] | None = None,
                 on_doubt: Callable[[Pending, str], None] | None = None,
                 key_usage: Callable[[], Awaitable[float | None]] | None = None, request_timeout_s: float = 0.0,
                 on_key_priced: Callable[[int, float, float], None] | None = None) -> None:
        self._spend = spend
        # Attempts without a generation id, priced from the key's usage (GET /key, `key_usage`) once
        # request_timeout_s has passed since they were sent; `on_key_priced` hears how many, what they
        # were priced at and their worst case.
        self._key_usage = key_usage
        self._request_timeout_s = request_timeout_s
        self._on_key_priced = on_key_priced
        self._unknown_task: asyncio.Task[None] | None = None
        # Set by close(): the loops end by it, not only by their cancel. On Python 3.11 a cancel that meets
        # `asyncio.wait_for` as its inner wait completes (the wake set in the same turn of the loop: an
        # attempt abandoned by the drain) is swallowed, and the pricing loop went on waiting: close()'s
        # gather, and so the drained run's exit, waited for ever. (It waits with asyncio.timeout now,
        # which passes the cancel on; the flag stays.)
        self._closed = False
        self._unknown_wake = asyncio.Event()
        self.key_failures = 0  # GET /key reads that failed or showed no usage (tried again KEY_RETRY_S later)
        # A record billed past what its attempt counted at (its reservation or token estimate): told with
        # the record's provider, booked at the record's cost all the same.
        self._on_over = on_over
        self._on_doubt = on_doubt  # a record whose cost is not believed: settled at its worst case
        # A believed record's bill with its native token counts (the run's price trust checks its prices).
        self.on_bill: Callable[[Pending, float, int, int], None] | None = None
        self.doubted = 0  # records not believed
        # False: the server bills nothing to look up (an answer keeps its token estimate, a lost attempt is
        # $0), the kind's `bills_answers`.
        self._bills = bills_answers
        self._client = client
        self._lookup_s = lookup_s
        self._on_settled = on_settled
        self._queue: asyncio.Queue[tuple[Pending, float]] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._busy = 0
        self.failures = 0     # lookups refused for another reason than "not there yet"

    def start(self) -> None:
        if not self._bills:  # what earlier runs left pending: nothing to look up, nothing billed
            self.add(list(self._spend.pending.values()))
            return
        if not self._workers:
            self._workers = [asyncio.create_task(self._work()) for _ in range(WORKERS)]

    def add(self, items: Iterable[Pending]) -> None:
        if not self._bills:
            settled = False
            for p in items:
                if p.id in self._spend.pending:
                    # An answer keeps its token estimate (what max_usd prices); a lost attempt bills nothing.
                    self._spend.settle(p, p.worst if p.answer else 0.0,
                                       CostSource.ESTIMATE if p.answer else CostSource.SELF_HOSTED)
                    settled = True
            if settled:
                self._on_settled()
            return
        now = time.monotonic()
        for p in items:
            if p.gen:
                self._queue.put_nowait((p, now))
            else:
                self._unknown_wake.set()  # one more to price from the key's usage when it is due

    @property
    def key_lag_s(self) -> float:
        """How long before reading GET /key the ledger's exact costs are taken (KEY_LAG_S)."""
        return min(KEY_LAG_S, self._lookup_s)

    @property
    def prices_unknown(self) -> bool:
        """Whether attempts without a generation id are priced from the key's usage (a key reader was given,
        the ledger has its baseline, the server is OpenRouter)."""
        return self._key_usage is not None and self._spend.key_baseline is not None and self._bills

    def start_unknown(self) -> None:
        """Start pricing attempts without a generation id from the key's usage (once the run has settled
        what the records on disk price better, opening.py `recorded_answers`)."""
        if self.prices_unknown and self._unknown_task is None:
            self._unknown_task = asyncio.create_task(self._price_unknown())

    @property
    def waiting(self) -> int:
        """Attempts being priced: lookups queued or under way, and those without a generation id that the
        key's usage will price (room.py waits for them when nothing else can free room)."""
        return self._queue.qsize() + self._busy + self.unknown_waiting

    @property
    def unknown_waiting(self) -> int:
        """Attempts without a generation id pending until the key's usage prices them (0 when it cannot:
        no baseline, no key pricing, or the task has stopped)."""
        task = self._unknown_task
        if task is None or task.done():
            return 0
        return len(self._spend.unknown())

    def unknown_due_s(self, now: float | None = None) -> float:
        """Seconds until the last attempt without a generation id can no longer be running (0: none)."""
        now = time.time() if now is None else now
        return max(0.0, max((p.sent_at + self._request_timeout_s - now for p in self._spend.unknown()), default=0.0))

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the lookups queued so far, then stop the workers (attempts
        without a generation id not due yet stay pending, for the next run or `draftgen ledger`)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.qsize() + self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.close()

    async def close(self) -> None:
        self._closed = True
        self._unknown_wake.set()  # a loop waiting on it sees the close at once, cancel swallowed or not
        tasks = [*self._workers, *([self._unknown_task] if self._unknown_task is not None else [])]
        for w in tasks:
            w.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers = []
        self._unknown_task = None

    async def _price_unknown(self) -> None:
        """Price the attempts without a generation id from the key's usage, all of them together once the
        last can no longer be running (one read of GET /key for a killed run's attempts, whose figure is
        the tightest); sleeps until then, or until another is added."""
        assert self._key_usage is not None
        while not self._closed:
            self._unknown_wake.clear()
            wait = self.unknown_due_s()
            if not wait and self._spend.unknown():
                due = due_unknown(self._spend, self._request_timeout_s)  # the exact costs taken before the read
                try:
                    await asyncio.sleep(self.key_lag_s)
                    usage = await self._key_usage()
                except (TimeoutError, RequestFailed, aiohttp.ClientError, OSError):
                    usage = None
                if usage is not None:
                    settled = settle_from_key(self._spend, due, usage)
                    if settled is not None:
                        if self._on_key_priced is not None:
                            self._on_key_priced(len(due.attempts), settled, due.worst)
                        self._on_settled()
                    continue
                self.key_failures += 1  # failed, or shows no usage
                if self.key_failures >= KEY_TRIES:  # they stay at their worst case (the next run tries)
                    return
                wait = KEY_RETRY_S
            if wait:
                with contextlib.suppress(TimeoutError):  # asyncio.timeout passes a cancel on; wait_for may not
                    async with asyncio.timeout(wait + 0.05):
                        await self._unknown_wake.wait()
            else:
                await self._unknown_wake.wait()

    async def _work(self) -> None:
        while not self._closed:
            p, first = await self._queue.get()
            self._busy += 1
            try:
                await self._look_up(p, first)
            finally:
                self._busy -= 1

    async def _look_up(self, p: Pending, first: float) -> None:
        delay = 0.25
        assert p.gen is not None
        not_found = 0  # 404s in a row (not a refusal or a network error)
        while p.id in self._spend.pending:
            try:
                record = await self._client.generation(p.gen)
                not_found = not_found + 1 if record is None else 0
            except (TimeoutError, RequestFailed, aiohttp.ClientError, OSError):
                record = None
                not_found = 0
                self.failures += 1
            if record is not None:
                cost, sane = record_cost(record, p.worst)
                if cost is None:
                    return  # a record without a cost: left pending at its worst case
                if not sane:
                    self.doubted += 1
                    self._spend.settle(p, p.worst, CostSource.WORST)
                    if self._on_doubt is not None:
                        self._on_doubt(p, repr(record.get("total_cost", record.get("usage")))[:40])
                    self._on_settled()
                    return
                self._spend.settle(p, cost)
                if self.on_bill is not None:
                    self.on_bill(p, cost, count_of(record.get("native_tokens_prompt")),
                                 count_of(record.get("native_tokens_completion")))
                if self._on_over is not None and cost > p.worst + 1e-12 and p.worst > 0:
                    self._on_over(p, cost, str(record.get("provider_name") or ""))
                self._on_settled()
                return
            if time.monotonic() - first + delay > self._lookup_s:
                if p.ended and not_found >= 2:
                    self._spend.settle(p, 0.0, CostSource.NO_RECORD)
                    self._on_settled()
                return  # still not there: pending for the next run or `draftgen ledger`
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
