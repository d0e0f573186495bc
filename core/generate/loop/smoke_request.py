"""A smoke test's terms for its requests (request.py `Terms`): the same `Request` and the same attempts
as a run's (each on the ledger before it leaves, booked as it ends), on the smoke test's own ledger.

What differs from a run's: a request is reserved against max_usd as one request outside a run's
admission (billing.py `reserve_one`: no room, no slot, written to the ledger at once), and a failure is
retried only when it is an outage of the service's (not an answer fault, which says something about
the request), with backoff honouring Retry-After, within the smoke test's tries and its one window of
time. Its answer is booked at what of its bill is believed, as a run's is; its outcome is booked as what
the smoke test (commands/smoke.py) makes its checklist row of: the answer and its seconds, or why the
request failed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import ANSWER_KINDS, Whose
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.api.prices import Prices, body_worst_case
from draftgen.core.generate.loop.request import Outcome, Request
from draftgen.core.generate.loop.service import backoff_delay
from draftgen.core.generate.money.billing import book_answer, look_up, reserve_one
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger


def outage(e: RequestFailed) -> bool:
    """A transient error of the service's (not an answer fault, which says something about the request;
    an error chunk coded 503 or 429 is the service's, RequestFailed.outage)."""
    return e.whose is Whose.TRANSIENT and (e.kind not in ANSWER_KINDS or e.outage)


@dataclass(frozen=True, slots=True)
class SmokeLedger:
    """The smoke test's money: the name its requests go on the ledger under, its ledger and settler, each
    dataset's worst-case prices (None: unknown), and its record of requests that left (a request left:
    the smoke test ran)."""
    name: str
    spend: SpendLedger
    settler: Settler | None
    prices: dict[str, Prices | None]
    sent: list[bool]


@dataclass(frozen=True, slots=True)
class SmokeWindow:
    """What bounds a smoke test's retries: its tries, the one window of time they share, their jitter."""
    tries: int
    deadline: float  # time.monotonic() by which a retry must have left
    rng: random.Random


@dataclass(slots=True)
class SmokeTerms:
    """The terms of one smoke request of dataset `ds`'s shape."""
    config: Config
    client: ChatClient
    ledger: SmokeLedger
    window: SmokeWindow
    ds: DatasetConfig
    spend: SpendLedger = field(init=False)
    settler: Settler | None = field(init=False)
    bills_answers: bool = field(init=False)  # whether a failure may be billed (the server kind's: billing.py)
    left_at: float = field(init=False, default=0.0)  # when its last attempt left (its answer timed from there)
    result: ChatAnswer | str = field(init=False, default="")  # booked: its answer, or why it failed (its row's)
    took: float = field(init=False, default=0.0)  # booked: its answer's seconds since its last attempt left

    def __post_init__(self) -> None:
        self.spend, self.settler = self.ledger.spend, self.ledger.settler
        self.bills_answers = self.config.api.server.kind.bills_answers

    def prices(self, req: Request) -> Prices | None:
        return self.ledger.prices[self.ds.name]

    async def reserve(self, req: Request) -> Outcome | None:
        """Reserved against max_usd at the worst case of the body sent and on the ledger as sent; UNSENT
        with why not (`req.why`)."""
        p = self.prices(req)
        worst = body_worst_case(p, req.body, self.ds.max_tokens) if p else 0.0
        ticket, why = reserve_one(self.spend, self.config.budget.max_usd, self.ledger.name, req.prompt.id, worst)
        if ticket is None:
            req.why = why
            return Outcome.UNSENT
        req.ticket = ticket
        self.left_at = time.monotonic()
        self.ledger.sent.append(True)
        return None

    async def failed(self, req: Request, e: RequestFailed) -> Outcome | None:
        """An outage retried after its backoff while the tries and the window allow; anything else fails."""
        req.error = e
        eng, window = self.config.engine, self.window
        delay = backoff_delay(min(req.tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after, window.rng)
        if outage(e) and req.tries < window.tries and time.monotonic() + delay <= window.deadline:
            await asyncio.sleep(delay)  # each retry goes on the ledger with its own reservation
            return None
        return Outcome.FAILED

    def answered(self, req: Request, answer: ChatAnswer) -> Outcome:
        assert req.ticket is not None
        look_up(self.settler, book_answer(self.spend, req.ticket, answer, self.prices(req)))
        req.answer = answer
        return Outcome.ANSWERED

    async def book(self, req: Request, outcome: Outcome) -> None:
        """The outcome booked as the smoke test's row reads it (`result`): the answer, timed from when its
        last attempt left (`took`), or why it was not sent or failed."""
        tries = req.tries
        if outcome is Outcome.ANSWERED:
            assert req.answer is not None
            self.result, self.took = req.answer, time.monotonic() - self.left_at
        elif outcome is Outcome.UNSENT:
            self.result = req.why + (f" (retry {tries} after an outage)" if tries else "")
        else:
            error = req.error
            assert error is not None
            self.result = f"{error.kind}: {error.message}" + (f" (after {tries} tries)" if tries > 1 else "")
