"""Token and money budgets: what stops admission, and why.

Tokens (per dataset): completion tokens of answers on disk plus the expected tokens of requests in
flight; a prompt is admitted only if its expected tokens still fit. Money (whole run): spend on
disk plus the expected cost of requests in flight against `max_usd`, and the live balance (last
fetched balance minus the spend since) minus in-flight cost against `credit_floor_usd`.
Overshoot is therefore bounded by what was in flight and how far answers exceed their estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Until this many answers have landed, the estimate of a request's tokens is half its max_tokens.
MIN_SAMPLES = 20


@dataclass
class TokenBudget:
    limit: int | None
    max_tokens: int
    used: int = 0          # completion tokens of answers on disk (all runs)
    answers: int = 0       # answers those tokens came from
    in_flight: int = 0     # sum of the expected tokens of admitted, unfinished requests

    def expected(self) -> int:
        """Expected completion tokens of the next request. A mean over landed answers is biased low
        early on (short answers land first), so it never goes below a quarter of max_tokens."""
        if self.answers < MIN_SAMPLES:
            return max(1, self.max_tokens // 2)
        return max(self.max_tokens // 4, min(self.max_tokens, round(self.used / self.answers)))

    def fits(self, expected: int) -> bool:
        return self.limit is None or self.used + self.in_flight + expected <= self.limit

    def remaining(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.used - self.in_flight)


class MoneyBudget:
    def __init__(self, max_usd: float | None, floor_usd: float, clock: Callable[[], float] = time.monotonic):
        self.max_usd = max_usd
        self.floor_usd = floor_usd
        self._clock = clock
        self.spent_before = 0.0      # on disk when this run started
        self.spent_run = 0.0         # answers landed in this process
        self.answers = 0             # answers (any run) whose cost is known
        self.in_flight = 0.0         # expected cost of requests in flight
        self.fallback_cost = 0.0     # cost per request before any answer (from smoke.json)
        self._balance: float | None = None
        self._balance_at: float | None = None
        self._spent_at_fetch = 0.0

    @property
    def spent_total(self) -> float:
        return self.spent_before + self.spent_run

    def expected_cost(self) -> float:
        if self.answers:
            return self.spent_total / self.answers
        return self.fallback_cost

    def set_balance(self, balance: float) -> None:
        self._balance = balance
        self._balance_at = self._clock()
        self._spent_at_fetch = self.spent_run

    def balance_now(self) -> float | None:
        if self._balance is None:
            return None
        return self._balance - (self.spent_run - self._spent_at_fetch)

    def balance_age(self) -> float | None:
        return None if self._balance_at is None else self._clock() - self._balance_at

    def over_max(self, expected: float) -> str | None:
        """Why `max_usd` allows no more requests (final for this run: the rest is skipped), or None."""
        if self.max_usd is not None and self.spent_total + self.in_flight + expected > self.max_usd:
            return (f"max_usd reached: spent ${self.spent_total:.2f} + ${self.in_flight:.2f} in flight "
                    f"of ${self.max_usd:.2f}")
        return None

    def below_floor(self, expected: float) -> str | None:
        """Why the live balance allows no more requests (an account condition: the run holds until the
        balance shows room again), or None."""
        balance = self.balance_now()
        if balance is not None and balance - self.in_flight - expected <= self.floor_usd:
            return (f"credit floor reached: balance ${balance:.2f} - ${self.in_flight:.2f} in flight "
                    f"<= floor ${self.floor_usd:.2f}")
        return None

    def blocked(self, expected: float) -> str | None:
        """Why no more requests may be admitted, or None."""
        return self.over_max(expected) or self.below_floor(expected)
