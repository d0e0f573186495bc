"""The sums behind the spend ceiling: reservations in flight, known costs, pending ones at worst case.

`SpendSums` holds what spend.jsonl's lines add up to (spend.py's `SpendReplay` reads them into it,
`SpendLedger` writes a line and then books it here); it touches no file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import StrEnum


class AttemptEnd(StrEnum):
    ANSWERED = "answered"
    REFUSED = "refused"
    ABANDONED = "abandoned"


# Members read through their class cost a lookup of the enum's metaclass each (~4x a plain global's):
# `SpendSums.book` (and the ledger's `answered`) name them for every request.
ANSWERED, ABANDONED = AttemptEnd.ANSWERED, AttemptEnd.ABANDONED


class Ticket:
    """One attempt's reservation; `sent` once its line is on disk."""
    __slots__ = ("id", "ds", "prompt_id", "worst", "gen", "gen_due", "sent", "open", "sent_at")

    def __init__(self, id: str, ds: str, prompt_id: str, worst: float) -> None:
        self.id = id
        self.ds = ds
        self.prompt_id = prompt_id
        self.worst = worst
        self.gen: str | None = None
        self.gen_due = False  # its generation id waits for the ledger's next write (spend_file.py)
        self.sent = False
        self.open = True
        self.sent_at = 0.0  # unix time its "sent" line was written


@dataclass
class Pending:
    """An attempt whose cost is not known yet, counted at its worst case."""
    id: str
    ds: str
    prompt_id: str
    worst: float
    gen: str | None     # None: the run died before the id came back; it cannot be looked up
    ended: bool = False   # a 500/502/503 ended it: no record after the lookups means not billed
    answer: bool = False  # an answer that carried no cost: booked as answered once priced
    # its "sent" line's "t" (or, given up on without a generation id, its end line's): a generation may run
    # on until request_timeout_s after it
    sent_at: float = 0.0
    left_open: bool = False  # no end line: a run died (or its disk refused the line) before the attempt ended


@dataclass(frozen=True)
class Reconciliation:
    answered: int
    answered_usd: float
    refused: int
    abandoned_settled: int
    abandoned_settled_usd: float
    pending: int            # abandoned or left open, with a generation id: can still be looked up
    pending_worst_usd: float
    unknown: int            # left without a generation id: counted at worst case for good
    unknown_worst_usd: float
    carried_usd: float
    total_usd: float        # every known cost (settled)

    @property
    def committed_usd(self) -> float:
        return self.total_usd + self.pending_worst_usd + self.unknown_worst_usd


@dataclass(slots=True)
class _Tally:
    """How many attempts ended one way, and what they cost."""
    n: int = 0
    usd: float = 0.0


class SpendSums:
    """Settled + pending + reserved, per dataset and by how each attempt ended (for `reconcile()`)."""

    def __init__(self) -> None:
        self._run = f"{os.getpid():x}{int(time.time() * 1000) % 0xFFFFFF:x}"
        self._n = 0
        self.settled_usd = 0.0
        self.spent_run = 0.0           # settled by this process
        self.reserved_usd = 0.0        # worst case of attempts in flight here
        self._reserved = 0             # open reservations: none left, reserved_usd is exactly 0
        self.pending: dict[str, Pending] = {}
        self.pending_usd = 0.0
        self.by_dataset: dict[str, float] = {}
        self.key_baseline: float | None = None  # GET /key usage before the directory's first attempt
        # For pricing attempts without a generation id from the key's usage (unknown.py): the costs of
        # attempts on this ledger known exactly (usage.cost, a generation record), which the key's usage
        # surely holds since the baseline, and what was priced from that usage so far, with its worst case.
        self.exact_usd = 0.0
        self.key_priced_usd = 0.0
        self.key_priced_worst = 0.0
        # For `reconcile()`.
        self._answered = _Tally()
        self._refused = 0
        self._settled_abandoned = _Tally()
        self._carried = 0.0
        self.found_usd = 0.0
        # For `count_unledgered` (opening.py): per dataset, the answers carry/found lines cover.
        self.covered: dict[str, int] = {}
        self.carried_by_cost: dict[str, float] = {}  # carry lines without "n"
        # Per dataset, each prompt's answered cost (read(answer_costs=True)): merge's kept-sample cost.
        self.answer_costs: dict[str, dict[str, float]] | None = None
        # Per (dataset, request-shape fingerprint), the highest worst prices (prompt, completion, request) that
        # answers' bills have checked ("prices" lines: core/generate/money/trust.py).
        self.prices_seen: dict[tuple[str, str], tuple[float, float, float]] = {}

    @property
    def committed_usd(self) -> float:
        """What the ceiling counts: known costs, pending ones at worst, and the reservations."""
        return self.settled_usd + self.pending_usd + self.reserved_usd

    @property
    def carried_usd(self) -> float:
        return self._carried

    @property
    def spent_usd(self) -> float:
        """Known costs plus pending ones at worst: the most the provider may have billed so far."""
        return self.settled_usd + self.pending_usd

    # -- reservations ----------------------------------------------------------------------

    def reserve(self, ds: str, prompt_id: str, worst: float) -> Ticket:
        self._n += 1
        self._reserved += 1
        self.reserved_usd += worst
        return Ticket(f"{self._run}-{self._n:x}", ds, prompt_id, worst)

    def release(self, t: Ticket) -> None:
        """A reservation never sent (cancelled before it left, or the disk refused its line)."""
        if t.open and not t.sent:
            self.close(t)

    def close(self, t: Ticket) -> bool:
        """Ends a ticket's reservation; False when it had ended already (its end is booked once)."""
        if not t.open:
            return False
        t.open = False
        self._reserved -= 1
        # Added and taken away in another order, the worst cases leave float crumbs (2e-17): with no
        # reservation open the sum is exactly 0.
        self.reserved_usd = max(0.0, self.reserved_usd - t.worst) if self._reserved else 0.0
        return True

    # -- known costs -----------------------------------------------------------------------

    def book(self, ds: str, cost: float, end: AttemptEnd, *, run: bool, exact: bool = False) -> None:
        """A known cost on the sums, counted by how its attempt ended (for `reconcile()`); `exact`: what
        was billed (usage.cost, a generation record), not an estimate above it."""
        self.settled_usd += cost
        if exact:
            self.exact_usd += cost
        by_dataset = self.by_dataset
        by_dataset[ds] = by_dataset.get(ds, 0.0) + cost
        if run:
            self.spent_run += cost
        if end is ANSWERED:
            tally = self._answered
        elif end is ABANDONED:
            tally = self._settled_abandoned
        else:
            self._refused += 1
            return
        tally.n += 1
        tally.usd += cost

    def book_settled(self, p: Pending, cost: float, *, run: bool, exact: bool = False,
                     from_key: bool = False) -> None:
        """A pending attempt priced; `from_key`: from the key's usage (unknown.py)."""
        self.book(p.ds, cost, AttemptEnd.ANSWERED if p.answer else AttemptEnd.ABANDONED, run=run, exact=exact)
        if from_key:
            self.key_priced_usd += cost
            self.key_priced_worst += p.worst

    def book_refused(self) -> None:
        """A refusal written by this process: nothing billed, only counted."""
        self._refused += 1

    def note_answer(self, ds: str, prompt_id: str, cost: float) -> None:
        if self.answer_costs is not None:  # a prompt answered twice (its line lost, asked again) cost both
            per = self.answer_costs.setdefault(ds, {})
            per[prompt_id] = per.get(prompt_id, 0.0) + cost

    def book_carried(self, ds: str, cost: float, answers: int | None) -> None:
        """A carry line: spend responses.jsonl held before the directory had a ledger."""
        self._book_earlier(ds, cost, answers)
        self._carried += cost

    def book_found(self, ds: str, cost: float, answers: int | None) -> None:
        """A found line: answers in responses.jsonl the ledger had no `sent` line for."""
        self._book_earlier(ds, cost, answers)
        self.found_usd += cost

    def _book_earlier(self, ds: str, cost: float, answers: int | None) -> None:
        if answers is not None:
            self.covered[ds] = self.covered.get(ds, 0) + answers
        self.settled_usd += cost
        self.by_dataset[ds] = self.by_dataset.get(ds, 0.0) + cost

    # -- pending ---------------------------------------------------------------------------

    def see_prices(self, ds: str, fingerprint: str, seen: tuple[float, float, float]) -> None:
        """Prices a bill checked for a dataset's request shape: the highest of each kept."""
        had = self.prices_seen.get((ds, fingerprint), seen)
        self.prices_seen[ds, fingerprint] = (max(had[0], seen[0]), max(had[1], seen[1]), max(had[2], seen[2]))

    def add_pending(self, p: Pending) -> None:
        self.pending[p.id] = p
        self.pending_usd += p.worst

    def drop_pending(self, aid: str) -> Pending | None:
        p = self.pending.pop(aid, None)
        if p is not None:
            self.pending_usd = max(0.0, self.pending_usd - p.worst) if self.pending else 0.0
        return p

    def lookups(self) -> list[Pending]:
        """Pending attempts that can still be priced (they have a generation id)."""
        return [p for p in self.pending.values() if p.gen]

    def unknown(self) -> list[Pending]:
        """Pending attempts without a generation id: priced from the key's usage (unknown.py)."""
        return [p for p in self.pending.values() if not p.gen]

    def reconcile(self) -> Reconciliation:
        known = [p for p in self.pending.values() if p.gen]
        unknown = [p for p in self.pending.values() if not p.gen]
        return Reconciliation(
            answered=self._answered.n, answered_usd=self._answered.usd, refused=self._refused,
            abandoned_settled=self._settled_abandoned.n, abandoned_settled_usd=self._settled_abandoned.usd,
            pending=len(known), pending_worst_usd=sum(p.worst for p in known),
            unknown=len(unknown), unknown_worst_usd=sum(p.worst for p in unknown),
            carried_usd=self._carried, total_usd=self.settled_usd)
