"""How far a run trusts its prices: the first wave, and prices raised to what the bills say.

A dataset's worst-case prices (prices.py) make every reservation, so a listing below what providers
bill lets a run pass `max_usd` by what each request in flight is under-reserved. Two checks:

- **The first wave.** With `max_usd` set and prices from the endpoints listing (not `[api]` prices,
  which are the user's word), a dataset of a concurrency above `FIRST_WAVE` has at most `FIRST_WAVE`
  requests in flight until its first answer comes back (its bill, when it carries one, checks the
  listing: below). When a bill of the wave raised the prices, it then admits none until the rest of
  the wave has ended (each booked at what it billed, each bill checked), so nothing reserved at prices
  found too low is still in flight when its concurrency opens; when the bills agreed, it opens at once
  (a slow request of the wave holds nothing back). What a wrong listing can cost before it is found
  out is those few requests, not the whole concurrency. (An answer without usage.cost, priced later
  from its generation record, ends the wave too, or a server that never sends a cost would keep the
  run at the wave for good: its bill checks the prices once the record comes.)
- **The highest price seen.** Every believed bill is held against the dataset's prices: a bill above
  its tokens at those prices raises them (each by the ratio, or, for prices of $0, to the bill over its
  counts) for every later reservation of the run, said once per dataset. Generation records count as
  bills too (their `total_cost` and native token counts, settle.py), so a server that sends no
  usage.cost is checked as well, once its records come. A raise is capped at $100 per
  million tokens (billing.py `SANE_USD_PER_TOKEN`), so one bill cannot make the rest of the run
  unaskable.

The prices a bill checked (the listing's, or raised) go on the spend ledger ("prices" line, per dataset
and request shape: `Config.fingerprint`), so a later run of the same shape in the directory reserves at
no less than them and has no first wave: only a directory's first run, or a new request shape, waits
for a bill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Mapping

from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.money.billing import SANE_USD_PER_TOKEN

FIRST_WAVE = 4
# A bill within this share above its tokens at the prices agrees with them (rounding of the provider's sums).
AGREES = 1.001


class PriceTrust:
    """Per dataset: whether a bill has checked its prices, and its prices raised to the highest bill seen.
    `prices` is the run's own dict (read by the room and the requests): a raise replaces its entry."""

    def __init__(self, prices: dict[str, Prices | None], *, first_wave: Container[str],
                 seen: Mapping[str, tuple[float, float, float]],
                 record: Callable[[str, Prices], None] = lambda name, p: None,
                 raised: Callable[[str, str], None] = lambda name, message: None) -> None:
        """`first_wave`: the datasets that start with one (their prices not yet checked in an earlier run);
        `seen`: per dataset, the prices bills checked in earlier runs of its request shape (prompt,
        completion, request); `record` puts the prices a bill checks (or raises) on the ledger; `raised`
        says a dataset's first raise (its name, the message)."""
        self._prices = prices
        self._record = record
        self._raised = raised
        self._said: set[str] = set()  # datasets whose raise was said
        self._wave: set[str] = set()
        self._recorded: dict[str, tuple[float, float, float]] = {}
        self._checked_as: dict[str, Prices] = {}  # the prices `_checked` last saw (their figures recorded)
        for name, p in prices.items():
            if p is None:
                continue
            was = seen.get(name)
            if was is None:
                if name in first_wave:
                    self._wave.add(name)
                continue
            if was[0] > p.prompt or was[1] > p.completion or was[2] > p.request:
                p = prices[name] = dataclasses.replace(
                    p, prompt=max(p.prompt, was[0]), completion=max(p.completion, was[1]),
                    request=max(p.request, was[2]), source=p.source + "; raised to the highest bill seen in this "
                    "directory")
            self._recorded[name] = (p.prompt, p.completion, p.request)
        self._unanswered = set(self._wave)
        self._drain: set[str] = set()  # in the wave, raised by a bill: the rest of the wave ends first

    def in_wave(self, name: str) -> bool:
        """The dataset is in its first wave (its concurrency not open yet)."""
        return name in self._wave

    def wave_holds(self, name: str, in_flight: int) -> bool:
        """Whether the first wave holds one more request of the dataset back (with `in_flight` in flight):
        at FIRST_WAVE until its first answer; then, when a bill of the wave raised the prices, until the
        wave has ended; then never again (the wave is over)."""
        if name not in self._wave:
            return False
        if name in self._unanswered:
            return in_flight >= FIRST_WAVE
        if in_flight and name in self._drain:
            return True
        self._wave.discard(name)
        return False

    def billed(self, name: str, answer: ChatAnswer, prompt_id: str) -> None:
        """An answer to prompt `prompt_id` (billing.py `believed` has taken out what of its bill is not
        believed): it ends the dataset's first wave; a bill with its token counts checks the dataset's
        prices (`bill`). Runs once per answer: the message naming it is made only for a raise."""
        self._unanswered.discard(name)
        if answer.priced:
            u = answer.usage
            if not self._agrees(name, u.cost, u.prompt_tokens, u.completion_tokens):
                self._raise(name, u.cost, u.prompt_tokens, u.completion_tokens, f"prompt {prompt_id!r}")

    def bill(self, name: str, cost: float, prompt_tokens: int, completion_tokens: int, what: str) -> None:
        """A believed bill (an answer's usage.cost, a generation record's total_cost) for these token counts,
        `what` naming it: the dataset's prices checked against it, and raised when it says more (said once
        per dataset through `raised`)."""
        if not self._agrees(name, cost, prompt_tokens, completion_tokens):
            self._raise(name, cost, prompt_tokens, completion_tokens, what)

    def _agrees(self, name: str, cost: float, prompt_tokens: int, completion_tokens: int) -> bool:
        """Whether a bill leaves the dataset's prices as they are: none known, no counts to check, or a cost
        within AGREES of its tokens at them (then on the ledger as checked, `_checked`)."""
        p = self._prices.get(name)
        if p is None or not (prompt_tokens or completion_tokens):
            return True
        if cost <= (prompt_tokens * p.prompt + completion_tokens * p.completion + p.request) * AGREES + 1e-12:
            if self._checked_as.get(name) is not p:  # the prices checked last (nearly every bill): on the ledger
                self._checked(name, p)
            return True
        return False

    def _raise(self, name: str, cost: float, prompt_tokens: int, completion_tokens: int, what: str) -> None:
        """A bill above the dataset's prices (`_agrees`): each raised by its ratio to them."""
        p = self._prices[name]
        assert p is not None
        listed = prompt_tokens * p.prompt + completion_tokens * p.completion + p.request
        if listed > 0:
            ratio = cost / listed
            prompt, completion, request = p.prompt * ratio, p.completion * ratio, p.request * ratio
        else:  # prices of $0: each part's price is at most the whole bill over its count
            prompt, completion, request = cost / max(1, prompt_tokens), cost / max(1, completion_tokens), 0.0
        now = dataclasses.replace(
            p, prompt=max(p.prompt, min(prompt, SANE_USD_PER_TOKEN)),
            completion=max(p.completion, min(completion, SANE_USD_PER_TOKEN)), request=max(p.request, request),
            source=p.source.split("; raised", 1)[0] + "; raised to the highest bill seen")
        if now == p:
            self._checked(name, p)
            return
        self._prices[name] = now
        self._checked(name, now)
        if name in self._wave:  # the wave's other requests were reserved at the prices found too low
            self._drain.add(name)
        if name not in self._said:
            self._said.add(name)
            self._raised(name, f"{what} billed ${cost:.6f} for {prompt_tokens:,} prompt and {completion_tokens:,} "
                         f"completion tokens, more than the worst prices allow ({p.describe()}): reservations now "
                         f"use the highest bill seen ({now.describe()})")

    def _checked(self, name: str, p: Prices) -> None:
        """A bill checked `p`: on the ledger for later runs, unless it is there already."""
        figures = (p.prompt, p.completion, p.request)
        if self._recorded.get(name) != figures:
            self._recorded[name] = figures
            self._record(name, p)
        self._checked_as[name] = p
