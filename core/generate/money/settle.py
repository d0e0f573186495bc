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

An openai-compatible server (`[api] kind`) has no generation records and bills nothing: what is
pending there (a request lost when the server died, a run killed mid-request) is settled at once,
an answer without a cost at its token estimate, anything else at $0 ("self-hosted"), so no phantom
worst case holds `max_usd`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import aiohttp

from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.money.billing import ABSURD_FACTOR, RUN_ON_USD
from draftgen.core.generate.money.spend import CostSource, Pending, SpendLedger
from draftgen.core.records import count_of

WORKERS = 8


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
                 on_settled: Callable[[], None] = lambda: None, *, self_hosted: bool = False,
                 on_over: Callable[[Pending, float, str], None] | None = None,
                 on_doubt: Callable[[Pending, str], None] | None = None) -> None:
        self._spend = spend
        # A record billed past what its attempt counted at (its reservation or token estimate): told with
        # the record's provider, booked at the record's cost all the same.
        self._on_over = on_over
        self._on_doubt = on_doubt  # a record whose cost is not believed: settled at its worst case
        # A believed record's bill with its native token counts (the run's price trust checks its prices).
        self.on_bill: Callable[[Pending, float, int, int], None] | None = None
        self.doubted = 0  # records not believed
        self._self_hosted = self_hosted
        self._client = client
        self._lookup_s = lookup_s
        self._on_settled = on_settled
        self._queue: asyncio.Queue[tuple[Pending, float]] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._busy = 0
        self.failures = 0     # lookups refused for another reason than "not there yet"

    def start(self) -> None:
        if self._self_hosted:  # what earlier runs left pending: nothing to look up, nothing billed
            self.add(list(self._spend.pending.values()))
            return
        if not self._workers:
            self._workers = [asyncio.create_task(self._work()) for _ in range(WORKERS)]

    def add(self, items: Iterable[Pending]) -> None:
        if self._self_hosted:
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

    @property
    def waiting(self) -> int:
        return self._queue.qsize() + self._busy

    async def drain(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the lookups queued so far, then stop the workers."""
        deadline = time.monotonic() + timeout_s
        while self.waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.close()

    async def close(self) -> None:
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self) -> None:
        while True:
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
