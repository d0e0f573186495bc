"""The account while a run goes: the balance read every `api.credits_interval_s`, and the holds.

An account condition (a 402, a key cap, a budget, the credit floor) stops admission run-wide:
requests in flight finish, nothing is failed, and the run is held until a re-read of GET /key and
GET /credits shows room for what is reserved plus the next request's worst case (then it resumes
by itself), or the user resumes it. A refused key (401) is not held: it drains the run.

The run's state is RunControl's (run_state.py): this watch holds the run through it, and tells the
engine when the key is refused (it drains) and when the hold has cleared (it resumes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from draftgen.core.generate.api.account import AccountStatus, AccountStop, read_account
from draftgen.core.generate.api.classify import AccountCondition, RequestFailed
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.run_state import Hold
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import Level

if TYPE_CHECKING:
    from draftgen.core.generate.loop.parts import RunParts


class AccountWatch:
    def __init__(self, ctx: RunContext, parts: RunParts, *, on_key_refused: Callable[[AccountStop], None],
                 on_cleared: Callable[[], None]) -> None:
        self._config = ctx.config
        self._money = parts.money
        self._spend = parts.spend
        self._datasets = parts.datasets
        self._run = ctx.control
        self._redact = ctx.redact
        self._event = ctx.event
        self._on_key_refused = on_key_refused  # the engine drains the run
        self._on_cleared = on_cleared          # the engine resumes the run (once the disk holds nothing)
        self.client = parts.opened.client
        self.status: AccountStatus | None = None     # the last read of GET /key and GET /credits
        self._recheck: asyncio.Task[None] | None = None
        self._next_worst = 0.0  # the worst case of the last request asked room for (room.py)

    def asking(self, worst: float) -> None:
        """A request asks room for `worst` now: a re-check must find room for it beside what is reserved."""
        self._next_worst = worst

    @property
    def balance_bound(self) -> bool:
        """The hold is one that only a fresh balance read can lift (a 402, the credit floor)."""
        stop = self._run.account
        return stop is not None and stop.condition in (AccountCondition.OUT_OF_CREDITS,
                                                                 AccountCondition.CREDIT_FLOOR)

    def floor_reached(self, reason: str) -> None:
        """The live balance reached credit_floor_usd: an account condition like a 402, met before it."""
        source = self.status.balance_detail if self.status is not None else "unknown"
        self.hold(AccountStop(AccountCondition.CREDIT_FLOOR, f"{reason}; balance from {source}"))

    def refused(self, e: RequestFailed) -> None:
        """A response said the account cannot go on (Whose.ACCOUNT): hold, or drain for a refused key."""
        condition = e.account or AccountCondition.FORBIDDEN
        self.hold(AccountStop.of(condition, self._redact(e.message)[:300], e.metadata))

    def hold(self, stop: AccountStop) -> None:
        if stop.condition is AccountCondition.KEY_REFUSED:
            if self._run.refuse_key(stop):  # the run's owner keeps it (RunControl.key_refused)
                self._on_key_refused(stop)
            return
        if self._run.closed:
            return
        if self._run.account is not None and self._run.paused:
            return  # already held (an answer in flight when it began)
        self._run.hold(Hold.ACCOUNT, stop.alert(), account=stop)
        if stop.recheck and (self._recheck is None or self._recheck.done()):
            self._recheck = asyncio.get_running_loop().create_task(self._recheck_until_clear())

    def cancel(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()

    async def _recheck_until_clear(self) -> None:
        """While a condition holds the run: read the account every credits interval, resume when it
        shows room again."""
        while self._run.account is not None and self._run.paused and not self._run.closed:
            await asyncio.sleep(self._config.api.credits_interval_s)
            stop = self._run.account
            if stop is None or not self._run.paused or self._run.closed:
                return
            try:
                status = await self.read()
            except RequestFailed as e:
                if e.account is AccountCondition.KEY_REFUSED:
                    self.refused(e)
                    return
                continue  # the account cannot be read now: try again next interval
            except Exception:  # noqa: BLE001 - a re-check must never take the run down
                continue
            # Room for what is still reserved plus the worst case of the next request, as admission asks.
            need = self._spend.reserved_usd + self._next_worst
            if stop.cleared_by(status, need_usd=need, floor_usd=self._money.floor_usd, now=time.time()):
                self._event(ev.AccountChanged(cleared=stop.condition.value, balance=status.balance_detail,
                                              at=Level.INFO))
                self._on_cleared()
                return

    async def read(self) -> AccountStatus:
        if not self._config.api.server.kind.has_account:  # no account behind an openai-compatible server
            self.status = AccountStatus()
            return self.status
        status = await read_account(self.client, management_key=self._config.api.management_key())
        first_unknown = status.balance is None and (self.status is None or self.status.balance is not None)
        self.status = status
        self._money.set_balance(status.balance, status.balance_source)
        if status.balance is not None:
            for ds in self._datasets.values():
                ds.wake.set()
        elif first_unknown:
            self._event(ev.CreditsRead(balance=self._redact(status.balance_detail)))
        return status

    async def read_then(self, resume: Callable[[], None]) -> None:
        """The user resumed a balance hold: read the balance first, then resume whatever it says (the
        next 402 holds the run again)."""
        try:
            await self.read()
        except Exception as e:  # noqa: BLE001 - resume anyway
            self._event(ev.CreditsRead(cause=type(e).__name__))
        if self._run.paused:
            resume()

    async def watch(self) -> None:
        """The balance, read every credits interval for the whole run (none on a self-hosted server)."""
        if not self._config.api.server.kind.has_account:
            return
        while True:
            try:
                await self.read()
            except RequestFailed as e:
                self._event(ev.CreditsRead(cause=self._redact(e.message)))
            except Exception as e:  # a balance check must never take the run down
                self._event(ev.CreditsRead(cause=type(e).__name__))
            await asyncio.sleep(self._config.api.credits_interval_s)
