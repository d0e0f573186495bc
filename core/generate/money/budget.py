"""Token and money budgets: what stops admission, and why.

Tokens (per dataset): completion tokens of answers on disk plus the expected tokens of requests in
flight; a prompt is admitted only if its expected tokens still fit (a soft budget: answers may run
past their estimate). Money (whole directory, all runs): a hard ceiling. Each attempt reserves its
worst-case cost before it leaves; known, pending and reserved spend plus the next reservation never
pass `max_usd` (spend.py says why a crash cannot break this), and the live balance (last fetched
balance minus the spend since) minus the reservations stays above `credit_floor_usd`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from draftgen.core.generate.money.spend import SpendLedger

# Until this many answers have landed, the estimate of a request's tokens is half its max_tokens.
MIN_SAMPLES = 20


class BlockReason(StrEnum):
    """What stops the next request: the two answers call for different handling (docs/budgets.md)."""
    MAX_USD = "max_usd"          # the run's ceiling: the rest is skipped, eligible for a later run
    CREDIT_FLOOR = "credit_floor"  # the balance: the run holds (nothing skipped) until it shows room


@dataclass(frozen=True)
class Block:
    """Why a request may not go out now: which limit, and the sentence the user reads."""
    reason: BlockReason
    message: str

    def __str__(self) -> str:
        return self.message


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
    """`max_usd` and `credit_floor_usd` over the spend ledger (spend.py): a request is admitted only
    if its worst case fits under the ceiling beside everything known, pending and reserved, and the
    live balance minus what is reserved stays above the floor."""

    def __init__(self, max_usd: float | None, floor_usd: float, spend: SpendLedger,
                 clock: Callable[[], float] = time.monotonic):
        self.max_usd = max_usd
        self.floor_usd = floor_usd
        self.spend = spend
        self._clock = clock
        self.balance_source = "unknown"   # "credits", "key limit" or "unknown"
        self._balance: float | None = None
        self._balance_at: float | None = None
        self._spent_at_fetch = 0.0
        self.limited_at: float | None = None  # last time the ceiling held back an admission

    @property
    def spent_total(self) -> float:
        return self.spend.spent_usd

    @property
    def spent_run(self) -> float:
        return self.spend.spent_run

    def set_balance(self, balance: float | None, source: str) -> None:
        self.balance_source = source if balance is not None else "unknown"
        self._balance = balance
        self._balance_at = None if balance is None else self._clock()
        self._spent_at_fetch = self.spend.spent_usd

    def balance_now(self) -> float | None:
        if self._balance is None:
            return None
        return self._balance - (self.spend.spent_usd - self._spent_at_fetch)

    def balance_age(self) -> float | None:
        return None if self._balance_at is None else self._clock() - self._balance_at

    def note_limited(self) -> None:
        self.limited_at = self._clock()

    def ceiling_limited(self, within_s: float = 2.0) -> bool:
        """The ceiling held back an admission lately: the reservations, not the slots, bound concurrency."""
        return self.limited_at is not None and self._clock() - self.limited_at < within_s

    def over_max(self, worst: float) -> str | None:
        """Why `max_usd` allows no request whose worst case is `worst` now, or None."""
        sp = self.spend
        if self.max_usd is not None and sp.committed_usd + worst > self.max_usd:
            return (f"max_usd reached: spent ${sp.settled_usd:.4f} + ${sp.pending_usd:.4f} pending + "
                    f"${sp.reserved_usd:.4f} reserved + ${worst:.4f} for the next request > ${self.max_usd:.2f}")
        return None

    def beyond_reach(self, worst: float) -> str | None:
        """Why `max_usd` can never allow a request whose worst case is `worst` in this run, even with
        every reservation in flight released (spent and pending only count), or None."""
        sp = self.spend
        if self.max_usd is not None and sp.spent_usd + worst > self.max_usd:
            left = max(0.0, self.max_usd - sp.spent_usd)
            return (f"its worst case ${worst:.4f} is more than max_usd leaves: ${self.max_usd:.2f} - "
                    f"${sp.spent_usd:.4f} spent (${sp.pending_usd:.4f} of it pending) = ${left:.4f}")
        return None

    def below_floor(self, worst: float) -> str | None:
        """Why the live balance minus what is reserved allows no request whose worst case is `worst`
        (an account condition: the run holds until the balance shows room again), or None."""
        if self._balance is None:
            return None
        sp = self.spend
        balance = self._balance - (sp.spent_usd - self._spent_at_fetch)  # balance_now, inlined: once per request
        if balance - sp.reserved_usd - worst <= self.floor_usd:
            return (f"credit floor reached: balance ${balance:.2f} - ${sp.reserved_usd:.2f} reserved "
                    f"<= floor ${self.floor_usd:.2f}")
        return None

    def blocked(self, worst: float) -> Block | None:
        """Why a request whose worst case is `worst` may not go out now (the ceiling first), or None."""
        if self.max_usd is None:
            if self._balance is None:  # no ceiling, no balance known: nothing to check
                return None
        elif (why := self.over_max(worst)) is not None:
            return Block(BlockReason.MAX_USD, why)
        if (why := self.below_floor(worst)) is not None:
            return Block(BlockReason.CREDIT_FLOOR, why)
        return None
