"""How far a run trusts its prices: the first wave, and prices raised to what the bills say.

A dataset's worst-case prices (prices.py) make every reservation, so a listing below what providers
bill lets a run pass `max_usd` by what each request in flight is under-reserved. Two checks:

- **The first wave.** With `max_usd` set and prices from the endpoints listing (not `[api]` prices,
  which are the user's word), a dataset has at most `FIRST_WAVE` requests in flight until an answer's
  bill (its usage.cost, believed, with its token counts) has checked the listing, and then admits none
  until the rest of that wave has ended (booked at what it billed), so nothing reserved at the unchecked
  prices is still in flight when its concurrency opens. What a wrong listing can cost before it is found
  out is those few requests, not the whole concurrency.
- **The highest price seen.** Every believed bill is held against the dataset's prices: a bill above
  its tokens at those prices raises them (each by the ratio, or, for prices of $0, to the bill over its
  counts) for every later reservation of the run, said once per dataset. A raise is capped at $100 per
  million tokens (billing.py `SANE_USD_PER_TOKEN`), so one bill cannot make the rest of the run
  unaskable. The raised prices last for the run; the next one starts from the listing (and its first
  wave) again.
"""

from __future__ import annotations

import dataclasses

from draftgen.core.generate.api.client import ChatAnswer
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.money.billing import SANE_USD_PER_TOKEN

FIRST_WAVE = 4
# A bill within this share above its tokens at the prices agrees with them (rounding of the provider's sums).
AGREES = 1.001


class PriceTrust:
    """Per dataset: whether a bill has checked its prices, and its prices raised to the highest bill seen.
    `prices` is the run's own dict (read by the room and the requests): a raise replaces its entry."""

    def __init__(self, prices: dict[str, Prices | None], *, first_wave: bool) -> None:
        self._prices = prices
        self._wave = {name for name, p in prices.items() if p is not None} if first_wave else set()
        self._unchecked = set(self._wave)

    def in_wave(self, name: str) -> bool:
        """The dataset is in its first wave (its concurrency not open yet)."""
        return name in self._wave

    def wave_holds(self, name: str, in_flight: int) -> bool:
        """Whether the first wave holds one more request of the dataset back (with `in_flight` in flight):
        at FIRST_WAVE until a bill checks its prices, then until the wave has ended (the wave is over then)."""
        if name not in self._wave:
            return False
        if name in self._unchecked:
            return in_flight >= FIRST_WAVE
        if in_flight:
            return True
        self._wave.discard(name)
        return False

    def billed(self, name: str, answer: ChatAnswer) -> tuple[Prices, Prices] | None:
        """An answer whose bill is believed (priced, billing.py `believed`): the dataset's prices checked
        against it, and raised when it says more. Returns (before, after) when they were raised."""
        u = answer.usage
        if not answer.priced or not (u.prompt_tokens or u.completion_tokens):
            return None
        self._unchecked.discard(name)
        p = self._prices.get(name)
        if p is None:
            return None
        listed = u.prompt_tokens * p.prompt + u.completion_tokens * p.completion + p.request
        if u.cost <= listed * AGREES + 1e-12:
            return None
        if listed > 0:
            ratio = u.cost / listed
            prompt, completion, request = p.prompt * ratio, p.completion * ratio, p.request * ratio
        else:  # prices of $0: each part's price is at most the whole bill over its count
            prompt, completion, request = u.cost / max(1, u.prompt_tokens), u.cost / max(1, u.completion_tokens), 0.0
        raised = dataclasses.replace(
            p, prompt=max(p.prompt, min(prompt, SANE_USD_PER_TOKEN)),
            completion=max(p.completion, min(completion, SANE_USD_PER_TOKEN)), request=max(p.request, request),
            source=p.source.split("; raised", 1)[0] + "; raised to the highest bill seen")
        if raised == p:
            return None
        self._prices[name] = raised
        return p, raised
