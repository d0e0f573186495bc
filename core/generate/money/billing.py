"""How an attempt's end goes on the spend ledger: who pays for it, and how sure the figure is.

Every path that sends a chat request (the run's attempts, the smoke test) books its end here, so
the same response is never priced two ways:

- an answer with `usage.cost`: answered at that cost, whatever its reservation was;
- an answer without it (a stream that closed after its last delta but before the usage chunk, a
  server that does not report cost): with a generation id, pending at its estimate until the record
  prices it (the settler); without one, answered at the estimate, tokens x the worst prices the
  routing allows (or the reservation, when the answer says no token counts either).
  Neither figure is capped at the reservation: a provider that bills past it (more tokens than
  max_tokens, more answers than asked) is booked at what it billed, so the ceiling sees it
  (`over_reservation` says by how much, for the run's event). With no price
  known at all (no ceiling set), the estimate is $0 ("estimate", not "usage.cost"), and the record,
  when there is an id, still prices it;
- nothing sent (the address could not be reached, TLS failed): refused, not billed;
- an HTTP 408 or 5xx that carried a generation id: a provider may have run (a 524 is the gateway
  giving up on an origin that runs on), so it is abandoned with its status and looked up. A 500,
  502 or 503 without a record after `generation_lookup_s` settles at $0 ("no record": answered at
  once, nothing runs on); a 408, 504 or 524 without one stays at its worst case, like a timeout;
- any other HTTP error status (400-429: the service's checks before a generation): refused;
- an answer a provider ran past max_tokens (PAST_CAP: not kept, see client.py): booked at what it
  billed. With its own usage.cost: abandoned and settled at once at that cost ("usage.cost"). Else,
  on OpenRouter with a generation id: pending at the larger of its reservation and its tokens at the
  worst prices until the record prices it; otherwise (a self-hosted server, no id) settled at once at
  that token estimate ("estimate"), the tokens counted, or estimated from the text streamed;
- everything else (a timeout, a cut body, an error inside a 200, stop-now): abandoned, and priced
  from the generation record when it has an id; without one it stays at its worst case.

What a server says it billed is checked before it is booked (`believed`): a usage.cost that is negative
or not a finite number, token counts that are not counts (answer.py `_usage_of`), or a figure beyond
what the request could cost (`cost_bound`: ten times its reservation, and never less than its token
bound at $100 per million tokens, far above any model's listed price; for an answer a provider ran past
its cap, which bills what it generated, up to `RUN_ON_USD`) is not believed. The answer is
then booked as one without a cost: its sane counts at the worst prices when they are within the bound,
else its worst case (its reservation), or its generation record's cost when it has an id (checked the
same way by the settler). One bad figure costs at most one reservation on the ledger, never more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

from draftgen.core.bodies import ChatBody
from draftgen.core.errors import DiskError
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import PastCap, RequestFailed
from draftgen.core.generate.api.prices import Prices, body_answers, body_max_tokens, body_prompt_bound
from draftgen.core.generate.money.spend import CostSource, Pending, SpendLedger, Ticket


class _Settles(Protocol):
    """Whoever prices attempts from their generation records (settle.py `Settler`, which imports this
    module: billing only needs its `add`)."""

    def add(self, items: Iterable[Pending]) -> None: ...


# A billed figure past both of these is not believed (`cost_bound`): ten times the reservation (a
# provider past max_tokens is cut at about 1.6x the cap), and never less than the request's token bound at
# $100 per million tokens (six times Kimi's price; o1-pro's $600/M output is the only listed price above,
# and its reservation is larger in proportion).
ABSURD_FACTOR = 10.0
SANE_USD_PER_TOKEN = 1e-4
# What one generation run on past its cap (a provider that ignores max_tokens, or keeps generating after the
# stream is closed) is believed to have cost at most: a million tokens at $100 per million, ~$105. Such a
# bill (the answer's usage, or its generation record's total_cost) is booked as billed up to this.
RUN_ON_USD = (1 << 20) * SANE_USD_PER_TOKEN
ABSURD_COST = "a cost beyond what the request could cost"
ABSURD_COUNT = "token counts beyond what the request could cost"


def cost_bound(worst: float, body: ChatBody | None) -> float:
    """The most an attempt reserved at `worst` for `body` is believed to have been billed."""
    tokens = 0 if body is None else (body_prompt_bound(body) + body_max_tokens(body, 0)) * body_answers(body)
    return max(ABSURD_FACTOR * worst, tokens * SANE_USD_PER_TOKEN)


def believed(answer: ChatAnswer, t: Ticket, prices: Prices | None, body: ChatBody | None) -> ChatAnswer:
    """The answer with what its usage says that is not believed taken out (`doubt` says what, "" when
    all is believed): a cost past `cost_bound` leaves it unpriced, counts whose estimate passes it are
    dropped too (it is then booked at its worst case, or its generation record). Checks the bound only
    for a figure above the reservation (most answers cost less)."""
    u = answer.usage
    if answer.priced and u.cost > t.worst and u.cost > cost_bound(t.worst, body):
        answer = dataclasses.replace(answer, priced=False, usage=dataclasses.replace(u, cost=0.0), doubt=ABSURD_COST)
        u = answer.usage
    if not answer.priced and prices is not None and (u.prompt_tokens or u.completion_tokens):
        guess = estimate(answer, prices, t.worst)
        if guess > t.worst and guess > cost_bound(t.worst, body):
            answer = dataclasses.replace(answer, usage=dataclasses.replace(u, prompt_tokens=0, completion_tokens=0,
                                                                           reasoning_tokens=0),
                                         doubt=answer.doubt or ABSURD_COUNT)
    return answer


def estimate(answer: ChatAnswer, prices: Prices | None, worst: float) -> float:
    """What an answer without usage.cost can have cost: its token counts at the worst prices (above the
    reservation when the counts are: what was billed is booked); the reservation itself when there are
    no counts."""
    u = answer.usage
    if prices is None or not (u.prompt_tokens or u.completion_tokens):
        return worst
    return u.prompt_tokens * prices.prompt + u.completion_tokens * prices.completion + prices.request


def booked_cost(answer: ChatAnswer, t: Ticket, prices: Prices | None) -> float:
    """What the ledger holds for an answer now: its usage.cost, else its token estimate (pending until its
    record prices it, when it has a generation id)."""
    return answer.usage.cost if answer.priced else _guess(answer, prices, t.worst)


def over_reservation(answer: ChatAnswer, t: Ticket, prices: Prices | None) -> float:
    """How far the cost booked for `answer` went past its reservation (0 when it did not)."""
    return _past(booked_cost(answer, t, prices), t.worst)


def _past(cost: float, worst: float) -> float:
    """How far `cost` went past the reservation `worst` (0 when it did not, or nothing was reserved)."""
    over = cost - worst
    return over if over > 1e-12 and worst > 0 else 0.0


def _guess(answer: ChatAnswer, prices: Prices | None, worst: float) -> float:
    # No price known (and so no ceiling): nothing to estimate with, $0 unless the record says more.
    return estimate(answer, prices, worst) if worst > 0 else 0.0


def as_booked(answer: ChatAnswer, t: Ticket, prices: Prices | None) -> ChatAnswer:
    """The answer with the cost the ledger booked for it, when that is final (an estimate without a
    generation id to look up), so its record and the cost columns say what the ledger holds."""
    if answer.priced or t.gen:
        return answer
    return dataclasses.replace(answer, usage=dataclasses.replace(answer.usage, cost=_guess(answer, prices, t.worst)))


def book_answer(spend: SpendLedger, t: Ticket, answer: ChatAnswer, prices: Prices | None) -> Pending | None:
    """Book an answer; returns what the settler should look up (an answer without a cost)."""
    if answer.priced:
        spend.answered(t, answer.usage.cost)
        return None
    guess = _guess(answer, prices, t.worst)
    if t.gen:
        return spend.answered_unpriced(t, guess)
    spend.answered(t, guess, CostSource.ESTIMATE)
    return None


def book_answered(spend: SpendLedger, t: Ticket, answer: ChatAnswer, prices: Prices | None,
                  settler: _Settles | None) -> tuple[ChatAnswer, float]:
    """A run's answer booked (`book_answer`, what is to be looked up handed to `settler`): the answer as
    booked (`as_booked`) and how far its cost went past its reservation (`over_reservation`)."""
    if answer.priced:  # nearly every answer: at its usage.cost, the answer as it is (one call, not five)
        cost = answer.usage.cost
        spend.answered(t, cost)
        return answer, _past(cost, t.worst)
    look_up(settler, book_answer(spend, t, answer, prices))
    answer = as_booked(answer, t, prices)
    return answer, over_reservation(answer, t, prices)


def book_failure(spend: SpendLedger, t: Ticket, e: RequestFailed, prices: Prices | None = None, *,
                 bills_answers: bool = True, body: ChatBody | None = None) -> Pending | None:
    """Book a request that got no answer (`body`: what it sent, which bounds what an answer run past its
    cap is believed to have cost; `bills_answers`: the server kind's, whether a generation record prices
    it); returns what the settler should look up."""
    if e.past_cap is not None:
        return _book_past_cap(spend, t, e.past_cap, prices, bills_answers, max(cost_bound(t.worst, body), RUN_ON_USD))
    if e.unreachable:  # no connection, so nothing was sent
        spend.refused(t)
        return None
    if e.status is not None:
        if t.gen and (e.status == 408 or e.status >= 500):
            return spend.abandoned(t, status=e.status)
        spend.refused(t)
        return None
    return spend.abandoned(t)


def past_cap_cost(cap: PastCap, t: Ticket, prices: Prices | None) -> float:
    """What an answer run past its cap cost at least: its usage at the worst prices, or, with only the
    tokens streamed, the reservation plus the tokens past the cap at the worst completion price."""
    if prices is None:
        return 0.0
    u = cap.usage
    if u is not None and (u.prompt_tokens or u.completion_tokens):
        return u.prompt_tokens * prices.prompt + u.completion_tokens * prices.completion + prices.request
    return t.worst + max(0, cap.tokens - cap.cap) * prices.completion


def _book_past_cap(spend: SpendLedger, t: Ticket, cap: PastCap, prices: Prices | None,
                   bills_answers: bool, bound: float) -> Pending | None:
    """Booked at its own cost, or its tokens at the worst prices; a figure past `bound` (what a generation run
    on is believed to cost at most) is not believed: its worst case instead (or its record's cost)."""
    if cap.priced and cap.usage is not None and cap.usage.cost <= bound:
        p = spend.abandoned(t)
        if p is not None:
            spend.settle(p, cap.usage.cost, CostSource.USAGE)
        return None
    cost = past_cap_cost(cap, t, prices)
    if cost > bound:
        cost = t.worst
    if t.gen and bills_answers:
        return spend.abandoned(t, at_least=cost)
    p = spend.abandoned(t)
    if p is not None:
        spend.settle(p, cost, CostSource.ESTIMATE)
    return None


def reserve_one(spend: SpendLedger, max_usd: float | None, ds: str, prompt_id: str,
                worst: float) -> tuple[Ticket | None, str]:
    """One request outside a run's admission (the smoke test's): reserved against `max_usd` at its
    worst case and on disk as sent, or None and why it is not sent."""
    if max_usd is not None and spend.committed_usd + worst > max_usd + 1e-12:
        return None, (f"not sent: max_usd ${max_usd:.2f} leaves no room (${spend.committed_usd:.4f} spent or "
                      f"held in {spend.path}, this request at worst ${worst:.6f})")
    ticket = spend.reserve(ds, prompt_id, worst)
    try:
        spend.send(ticket)
    except DiskError as e:
        spend.release(ticket)
        return None, f"not sent: the spend ledger cannot be written ({e})"
    return ticket, ""


def look_up(settler: _Settles | None, pending: Pending | None) -> None:
    """Hand an attempt to be priced from its generation record to the settler, when there is one."""
    if settler is not None and pending is not None:
        settler.add((pending,))
