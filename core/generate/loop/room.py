"""Room for one more request: what a request (request.py) asks before it or its retry starts.

A request waits while the run is paused, while a doubted dataset's one probe is out (doubts.py), while
its dataset's answers in flight may still free token budget, while settling money in flight may free
room under max_usd (lookups, and attempts without a generation id that the key's usage will price once
they cannot still be running: the run waits for those and says so, rather than ending LIMITED), and
while its dataset is at its concurrency limit (or in its first wave: under max_usd with the listing's
prices, until its first answer's bill has checked them, trust.py). Each request reserves the worst
case of the very body it sends; a prompt whose worst case would not fit under max_usd even with nothing
in flight is skipped (counted, eligible later). The balance reaching credit_floor_usd holds the run
instead of skipping anything. A retry over a limit lowered by 429s waits for a slot holding none.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from draftgen.core.bodies import ChatBody
from draftgen.core.config_tables import DatasetConfig, cycle_index
from draftgen.core.generate.api.prices import body_prompt_bound, prompt_token_bound
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.money.budget import Block, BlockReason
from draftgen.core.generate.money.spend import Ticket
from draftgen.core.generate.money.trust import FIRST_WAVE, PriceTrust
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import Level
from draftgen.core.request_keys import body_answers, body_max_tokens

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun
    from draftgen.core.generate.loop.parts import RunParts
    from draftgen.core.generate.loop.watch import AccountWatch


class Admit(Enum):
    GO = "go"            # admit now
    HALT = "halt"        # drain, stop, or the dataset has no endpoints: keep the prompt, admit nothing
    BUDGET = "budget"    # a budget ran out for this dataset: the rest is skipped
    SKIP = "skip"        # this prompt's worst case never fits what max_usd leaves: skip it, go on


@dataclass(frozen=True)
class Decision:
    verdict: Admit
    reason: str = ""     # for BUDGET: which budget and how far it got
    money: bool = False  # the budget is max_usd (the run ends LIMITED, not DONE)


GO = Decision(Admit.GO)
HALT = Decision(Admit.HALT)
# On Python 3.11 an Enum member read off its class goes through EnumType.__getattr__ (about 5x a module
# global's read): the verdict compared on every request is read once, here.
VERDICT_GO = Admit.GO


class _Wait(Enum):
    """What a request held back waits for before admission looks again (`admit`: the gate while the run
    is not open, else its dataset's wake)."""
    WAKE = "wake"  # its dataset's wake: an answer in flight came back, or money settled
    GATE = "gate"  # the run's gate: the run is held at the credit floor


class _Made:
    """A dataset's request body without its messages, and the parts of its worst case that are the
    dataset's (prices.py body_worst_case), as of one epoch of the run's server profile (servers.py)."""
    __slots__ = ("epoch", "body", "cap", "answers", "tools_bound")

    def __init__(self, epoch: int, body: ChatBody, max_tokens: int) -> None:
        self.epoch = epoch
        self.body = body
        self.cap = body_max_tokens(body, max_tokens)
        self.answers = body_answers(body)
        self.tools_bound = body_prompt_bound(body) - prompt_token_bound(())  # what the tools add


def _cycle_place(config: DatasetConfig, index: int) -> tuple[int, int]:
    """Where prompt `index` sits in the dataset's sampling cycles: prompts at the same place send the same
    body but for their messages (Config.request_body's `index`)."""
    temps, efforts = config.temperatures, config.reasoning_efforts
    return (index % len(temps) if temps else 0, index % len(efforts) if efforts else 0)


def price_trust(ctx: RunContext, parts: RunParts) -> PriceTrust:
    """The run's price trust (trust.py): under max_usd with the listing's prices, a first wave for each
    dataset whose concurrency is above it and whose request shape no bill in this directory has checked
    (the ledger's "prices" lines), said once; raises said once per dataset; generation records' bills
    checked too (the settler's `on_bill`)."""
    config, opened, spend, datasets = ctx.config, parts.opened, parts.spend, parts.datasets
    api = config.api
    listed = config.budget.max_usd is not None and api.prompt_price_per_mtok is None \
        and api.completion_price_per_mtok is None
    shapes = {name: config.fingerprint(ds.config) for name, ds in datasets.items()}
    seen = {name: was for name, f in shapes.items() if (was := spend.sums.prices_seen.get((name, f))) is not None}
    wave = {name for name, ds in datasets.items() if listed and ds.config.concurrency > FIRST_WAVE}
    trust = PriceTrust(opened.costs.prices, first_wave=wave, seen=seen,
                       record=lambda name, p: spend.prices_checked(name, shapes[name], p.prompt, p.completion,
                                                                   p.request),
                       raised=lambda name, message: ctx.event(ev.PriceNote(raised=message, dataset=name,
                                                                          at=Level.WARN)))
    opened.costs.settler.on_bill = lambda p, cost, prompt_tokens, completion_tokens: trust.bill(
        p.ds, cost, prompt_tokens, completion_tokens, f"prompt {p.prompt_id!r} (its generation record)")
    if waves := [name for name in datasets if trust.in_wave(name)]:
        ctx.event(ev.PriceNote(wave=", ".join(waves), first_wave=FIRST_WAVE))
    return trust


class Room:
    """Whether one more request (or retry) of a dataset may go out now, and what max_usd left unasked."""

    def __init__(self, ctx: RunContext, parts: RunParts, watch: AccountWatch, *,
                 trust: PriceTrust | None = None) -> None:
        opened = parts.opened
        self._money = parts.money
        self._control = ctx.control
        self._book = parts.book
        self._watch = watch  # the balance reached credit_floor_usd: the watch holds the run
        self._datasets = parts.datasets
        self._event = ctx.event
        self._settler = opened.costs.settler  # abandoned attempts being priced: settling them may free room
        self._body = ctx.config.request_body  # the exact request body: the reservation is its worst case
        self._server = ctx.config.api.server  # what was found of the server: a note since changes the body
        # per dataset and place in its sampling cycles: the body without its messages
        self._bodies: dict[tuple[str, tuple[int, int]], _Made] = {}
        self.prices = opened.costs.prices
        # The prices' first wave and raises (trust.py): the run's, else none (a room built alone).
        self.trust = trust or PriceTrust(self.prices, first_wave=(), seen={})
        # Prompts skipped because their worst case did not fit what max_usd left, per dataset.
        self.money_skipped: dict[str, int] = {}
        self._money_stopped: set[str] = set()  # datasets whose rest max_usd skipped
        self._retries_waiting = 0
        self._unknown_said = 0  # how many attempts without a generation id the last wait for them named
        # max_usd held the last request back waiting for those to be priced (cleared by the next admitted)
        self.waits_for_unknown = False

    def _in_flight(self) -> int:
        """Requests in flight over every dataset."""
        return sum(d.in_flight for d in self._datasets.values())

    def request_for(self, ds: DatasetRun, prompt: Prompt) -> tuple[ChatBody, float]:
        """The body this prompt's request sends, and what sending it can cost at most (0 when no price
        is known and no ceiling is set): the worst case of that very body, its own max_tokens (with the
        dataset's sampling cycle at the prompt's line, `cycle_index`)."""
        config = ds.config
        epoch = self._server.epoch
        # Without sampling cycles every prompt of the dataset sends the same body (no place to work out).
        place = (_cycle_place(config, cycle_index(prompt.line)) if config.temperatures or config.reasoning_efforts
                 else (0, 0))
        key = (config.name, place)
        made = self._bodies.get(key)
        if made is None or made.epoch != epoch:  # the dataset's first prompt, or a server's kind or mode noted since
            made = self._bodies[key] = _Made(epoch, self._body(config, [], index=cycle_index(prompt.line)),
                                             config.max_tokens)
        body = made.body.copy()  # the config's part, built once per dataset: only `messages` is the prompt's
        body["messages"] = prompt.messages
        tools_bound = made.tools_bound
        if prompt.turn is not None and prompt.turn.tools:  # an agent line's step: the line's tools are sent
            body["tools"] = prompt.turn.tools
            tools_bound = body_prompt_bound({"tools": prompt.turn.tools}) - prompt_token_bound(())
        prices = self.prices.get(config.name)
        # body_worst_case(prices, body, max_tokens), its parts that are the dataset's computed once.
        return body, 0.0 if prices is None else (
            prices.worst_case(prompt_token_bound(prompt.messages) + tools_bound, made.cap) * made.answers)

    @property
    def money_limited(self) -> bool:
        """max_usd left some prompt unasked this run (skipped, eligible for a later run)."""
        return bool(self._money_stopped) or any(self.money_skipped.values())

    def stop_for_money(self, name: str) -> None:
        """max_usd ended the dataset: the rest of its prompts is skipped."""
        self._money_stopped.add(name)

    def skip_for_money(self, ds: DatasetRun, prompt_id: str, reason: str) -> None:
        """Skip one prompt max_usd has no room for (counted, not failed: it stays eligible); said for
        the first of each dataset, counted in its dataset_done line."""
        name = ds.config.name
        ds.skipped_some()
        n = self.money_skipped[name] = self.money_skipped.get(name, 0) + 1
        if n == 1:
            why = reason or "max_usd leaves no room"
            self._event(ev.Budget(reason=why, prompt_id=prompt_id, dataset=name))

    def admit_now(self, ds: DatasetRun, worst: float) -> Decision | None:
        """`admit` without waiting: GO, HALT or the budget that stops it when that is decided now, None
        when the request must wait (then `admit` waits; a prompt goes out here almost always)."""
        control = self._control
        if control.closed or ds.stopped:
            return HALT
        if not control.is_open:
            return None  # paused or held: it waits for the gate
        held = self._held_back(ds, worst)
        if held is None:
            self.waits_for_unknown = False
            return GO
        # Decision or _Wait: asked of Decision, as isinstance with an Enum class is about 5x slower (3.11)
        return held if isinstance(held, Decision) else None

    async def admit(self, ds: DatasetRun, worst: float) -> Decision:
        """Wait until the dataset may send one more request costing at most `worst`; GO, HALT, or the
        budget that stops it."""
        while (decided := self.admit_now(ds, worst)) is None:
            if not self._control.is_open:  # paused, or held (the credit floor's hold too: _money_held)
                await self._control.wait_open()
            else:  # its dataset's wake: a request ended, money settled, the limit grew
                ds.wake.clear()
                await ds.wake.wait()
        return decided

    def _held_back(self, ds: DatasetRun, worst: float) -> Decision | _Wait | None:
        """What keeps one more request of `ds` from going out now, in the order they are checked: its
        doubts, its token budget, the money, its concurrency limit. None when nothing does."""
        # set aside by a 4xx naming no cause (doubts.py): one probe at a time (`held` not asked while none is)
        if ds.doubts.items and ds.doubts.held:
            doubted = self._doubted(ds)
            if doubted is not None:
                return doubted
        budget = ds.token_budget
        if budget.limit is not None and not budget.fits(budget.expected()):
            # This dataset's answers in flight may come in under their estimate and free room.
            if ds.in_flight:
                return _Wait.WAKE
            return Decision(Admit.BUDGET, f"token budget reached: {budget.used:,} used + "
                            f"{budget.in_flight:,} in flight of {budget.limit:,}")
        self._watch.asking(worst)  # what a re-check of the account must find room for
        block = self._money.blocked(worst)
        if block is not None:
            return self._money_held(ds, worst, block)
        in_flight = ds.in_flight  # a property: read once
        if in_flight >= ds.concurrency.limit or self.trust.wave_holds(ds.config.name, in_flight):
            return _Wait.WAKE
        return None

    def _doubted(self, ds: DatasetRun) -> Decision | _Wait | None:
        """A doubted dataset stops when its doubts are given up, and waits while its one probe is out."""
        if ds.doubts.given_up:
            if self._book.stop_doubted(ds):
                self._event(ev.DatasetStopped(cause=ds.message, dataset=ds.config.name))
            return HALT
        if ds.doubts.probe_out:
            return _Wait.WAKE
        return None

    def _money_held(self, ds: DatasetRun, worst: float, block: Block) -> Decision | _Wait:
        """max_usd or the credit floor has no room for `worst` now: skip the prompt, wait for money in
        flight to settle, hold the run at the floor, or end the dataset at max_usd."""
        # Answers settling below their reservation free room; near the end fewer go out, not none.
        if not self._settler.waiting:
            # Even with every request in flight settled at $0 it would not fit: skip it, go on.
            beyond = self._money.beyond_reach(worst)
            if beyond is not None:
                self._money.note_limited()
                return Decision(Admit.SKIP, beyond)
        if self._in_flight() or self._settler.waiting:
            self._money.note_limited()
            if self._settler.unknown_waiting:
                self.waits_for_unknown = True
                self._say_unknown_wait()
            return _Wait.WAKE
        if block.reason == BlockReason.CREDIT_FLOOR:
            # The balance, not a budget: hold the run (nothing skipped) until it shows room again.
            self._watch.floor_reached(block.message)
            if self._control.is_open:  # the hold was refused (draining): admit nothing
                return HALT
            return _Wait.GATE
        return Decision(Admit.BUDGET, block.message, money=True)

    def unknown_wait(self) -> str:
        """What the run waits for, when max_usd holds it back only by attempts without a generation id
        (empty otherwise): the snapshot's `waiting`, for the header and the headless line."""
        if not self.waits_for_unknown or self._in_flight() or not (n := self._settler.unknown_waiting):
            return ""
        return (f"max_usd has no room but for {n} attempt(s) without a generation id (counted at worst case): "
                f"priced from the key's usage in {self._settler.unknown_due_s():.0f} s at most")

    def _say_unknown_wait(self) -> None:
        """Say (once for each number of them) that max_usd waits for attempts without a generation id to be
        priced from the key's usage, rather than ending the run."""
        unknown = self._money.spend.unknown()
        if len(unknown) == self._unknown_said:
            return
        self._unknown_said = len(unknown)
        self._event(ev.PendingAttempts(case="waits", attempts=len(unknown), worst_usd=sum(p.worst for p in unknown),
                                       due_s=self._settler.unknown_due_s(), at=Level.WARN))

    async def reserve_retry(self, ds: DatasetRun, prompt_id: str, worst: float) -> Ticket | None:
        """A new reservation for a retry (the last attempt's may be pending at its worst case); None when
        the ceiling leaves no room and nothing in flight or being priced can free any."""
        while True:
            if self._control.closed:  # a drain or stop, also one that came while it waited for room
                return None
            block = self._money.blocked(worst)
            if block is None:
                return self._money.spend.reserve(ds.config.name, prompt_id, worst)
            if self._in_flight() - self._retries_waiting - 1 <= 0 and not self._settler.waiting:
                if block.reason == BlockReason.MAX_USD or self._control.draining:
                    return None
                # The balance, not the ceiling: hold the run (nothing skipped) until it shows room again.
                self._watch.asking(worst)
                self._watch.floor_reached(block.message)
                if self._control.is_open:  # the hold was refused (draining)
                    return None
                await self._control.wait_open()
                continue
            self._money.note_limited()
            self._retries_waiting += 1
            try:
                ds.wake.clear()
                await ds.wake.wait()
            finally:
                self._retries_waiting -= 1

    async def retry_slot(self, ds: DatasetRun) -> None:
        """A retry goes out only within the current limit. After sustained 429s cut it, the requests
        over it wait here holding no slot, so what the provider receives drops with the limit; without
        this only new admissions stopped, and every request already in flight kept retrying."""
        if ds.in_flight - ds.parked <= ds.concurrency.limit:
            return
        ds.park()
        try:
            while ds.in_flight - ds.parked >= ds.concurrency.limit:
                ds.wake.clear()
                await ds.wake.wait()  # set when a request ends and when the limit grows
        finally:
            ds.unpark()
