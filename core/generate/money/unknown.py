"""Pricing the attempts that have no generation id from the key's usage, by default.

An attempt a run sent but whose answer's headers it never read (the run was killed, or the request
timed out before them) has no generation id, so no record to look it up by. What it cost is in the
key's usage (GET /key `data.usage`, all the key ever spent) once it cannot still be running: a
non-streamed generation runs on after its client left and is billed when it ends, taken to be at
most `api.request_timeout_s` after it was sent (the `sent` line's `t`; for one given up on in a run,
a timeout before any header, after it was given up on: its end line's `t`); an aborted stream is
billed when it stops.

The ledger's first run recorded the key's usage before the directory's first attempt (the `key`
line, the baseline B). Read again at a moment U, the key's usage since then holds everything billed
to the key since B: the attempts of this directory billed by then, and whatever else the key ran.
So once every attempt priced here had ended before U was read,

    what they cost together <= U - B - E

where E is what the ledger knows exactly was billed (`exact_usd`: usage.cost of answers, generation
records; never an estimate, which may be above what was billed), taken before U is read (a few
seconds before, settle.py KEY_LAG_S, so that a charge the key's usage shows late is in it) so that
all of it is in U. The rest (pending attempts, requests in flight, estimates, spend carried from before
the ledger) is counted at $0 there, which only makes the bound larger. A key shared with other work
makes it larger still, so it is capped at the attempts' worst case: an attempt priced here never
counts more than it did, and the ceiling (settled + pending + reserved + next <= max_usd) only gains
room.

Several pricings (a directory killed more than once) form one group: the attempts priced from the
key before (`key_priced_usd`, their worst case `key_priced_worst`) and the new ones together cost at
most min(their worst case, U - B - E). The new ones are booked at what that leaves above what the
group already holds (never below $0, never above their worst case), so the ledger's key-priced total
is never below what the group was billed, and the ledger's total never below the bill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from draftgen.core.generate.money.spend import CostSource, Pending, SpendLedger


@dataclass(frozen=True)
class Due:
    """The attempts without a generation id that cannot still be running, and when the next of the
    others can no longer be (`next_s` seconds from now; 0 when there are none)."""
    attempts: list[Pending]
    next_s: float
    exact_usd: float  # the ledger's exact costs when they were taken: read the key's usage after this

    @property
    def worst(self) -> float:
        return sum(p.worst for p in self.attempts)


def due_unknown(spend: SpendLedger, request_timeout_s: float, now: float | None = None) -> Due:
    """Take the attempts without a generation id that ended before now (sent at least
    `request_timeout_s` ago), with the ledger's exact costs as of now: the key's usage read after
    this call holds both."""
    now = time.time() if now is None else now
    attempts: list[Pending] = []
    next_s = 0.0
    for p in spend.unknown():
        left = p.sent_at + request_timeout_s - now
        if left <= 0:
            attempts.append(p)
        elif not next_s or left < next_s:
            next_s = left
    return Due(attempts, next_s, spend.exact_usd)


def key_share(spend: SpendLedger, due: Due, usage: float) -> float | None:
    """What the attempts of `due` cost together at most, by the key's `usage` read after `due` was
    taken (see the module's docstring); None without a baseline or anything to price."""
    baseline = spend.key_baseline
    if baseline is None or not due.attempts:
        return None
    worst = due.worst
    room = max(0.0, usage - baseline - due.exact_usd)
    group = min(spend.key_priced_worst + worst, room)
    return min(worst, max(0.0, group - spend.key_priced_usd))


def settle_from_key(spend: SpendLedger, due: Due, usage: float) -> float | None:
    """Settle the attempts of `due` still pending at their `key_share`, shared out in proportion to each
    one's worst case ("key usage" settle lines). Returns the amount settled, None when nothing was."""
    share = key_share(spend, due, usage)
    if share is None:
        return None
    attempts = [p for p in due.attempts if p.id in spend.pending]
    worst = sum(p.worst for p in attempts)
    if not attempts:
        return None
    share = min(share, worst)  # priced meanwhile otherwise (a gen line read late): never more than they hold
    for p in attempts:
        spend.settle(p, share * p.worst / worst if worst > 0 else 0.0, CostSource.KEY_USAGE)
    return share
