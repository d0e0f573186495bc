"""The run loop's parts, built once the run has opened what they need.

`Engine.run` opens the client, the money (prices, the settler, the last smoke answer) and the
datasets (what is on disk, the cross-dataset duplicates); only then is a `RunLoop` built, whole:
admission, attempts and the account watch get the client, prices, settler and duplicates in their
constructors, so none of them is half-built while the run goes. The loop also books each request's
outcome (`request`): an answer or failure through the record book, a prompt handed back to its dataset,
an account condition to the watch, a dataset stopped.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftgen.core.config import Config, sampling_of
from draftgen.core.generate.api.account import AccountStop
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.preflight import detect_server
from draftgen.core.generate.loop.admission import Admission
from draftgen.core.generate.loop.attempts import Attempts, Outcome
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.loop.opening import Money
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.loop.request import Request
from draftgen.core.generate.loop.run_state import Hold, RunControl
from draftgen.core.generate.loop.source import HANDED_BACK, Booked
from draftgen.core.generate.loop.stats import Tally
from draftgen.core.generate.loop.watch import AccountWatch
from draftgen.core.generate.money.budget import MoneyBudget
from draftgen.core.generate.money.spend import SpendLedger, Ticket
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.records import ErrorKind
from draftgen.core.secrets import Redactor
from draftgen.core.servers import ids_plan, missing_ids_message, server_noted


@dataclass(frozen=True)
class Opened:
    """What the run opened before its first request."""
    client: ChatClient
    money: Money
    duplicates: CrossDatasetDuplicates | None


@dataclass(frozen=True)
class Parts:
    """What the engine owns from its construction, that the loop works with."""
    config: Config
    datasets: dict[str, DatasetRun]
    money: MoneyBudget
    spend: SpendLedger
    control: RunControl
    book: RecordBook
    errors: Tally
    recent: RecentErrors
    provider_stats: ProviderStats
    redact: Redactor
    event: snap.EventSink
    clock: Callable[[], float]


class RunLoop:
    """Admission, attempts and the account watch of one run, and the booking of each outcome."""

    def __init__(self, parts: Parts, opened: Opened, rng: random.Random, *, drain: Callable[[], None],
                 resume: Callable[[], None]) -> None:
        self._p = parts
        self._drain = drain    # the engine's drain (a refused key)
        self._resume = resume  # the engine's resume (an account condition cleared)
        self._ids_said = False  # why answers come without the server's ids was said
        settler = opened.money.settler
        cfg = parts.config
        self.admission = Admission(parts.datasets, parts.money, parts.control, parts.book, self.request, parts.event,
                                   on_floor=lambda reason: self.watch.floor_reached(reason),
                                   settling=lambda: settler.waiting, body=cfg.request_body,
                                   prices=opened.money.prices, duplicates=opened.duplicates,
                                   self_hosted=cfg.api.self_hosted)
        self.attempts = Attempts(cfg, parts.control, parts.errors, rng, room=self.admission, spend=parts.spend,
                                 client=opened.client, settler=settler, prices=opened.money.prices,
                                 on_event=parts.event, redact=parts.redact, clock=parts.clock, recent=parts.recent)
        self.watch = AccountWatch(cfg, parts.money, parts.spend, self.admission, parts.control, parts.redact,
                                  parts.event, client=opened.client, on_key_refused=self._key_refused,
                                  on_cleared=self._account_cleared)

    async def run(self) -> None:
        """Every dataset admitted until it has nothing left (or a budget, drain or stop ends it)."""
        await self._server_ids()
        beside = [asyncio.create_task(self.admission.grow_limits()), asyncio.create_task(self.watch.watch())]
        try:
            datasets = self._p.datasets.values()
            if self._p.config.engine.parallel:
                await asyncio.gather(*(self.admission.run(ds) for ds in datasets))
            else:
                for ds in datasets:
                    await self.admission.run(ds)
        finally:
            for task in beside:
                task.cancel()
            self.watch.cancel()

    async def request(self, req: Request, ticket: Ticket, body: dict[str, Any]) -> None:
        """One admitted prompt asked until it has an outcome, the outcome booked, its source told."""
        p = self._p
        ds, prompt = req.ds, req.prompt
        done = await self.attempts.ask(ds, body, ticket)  # the body the ticket reserved for
        if done.outcome is Outcome.ANSWERED:
            assert done.answer is not None
            p.provider_stats.answer(done.answer.provider or "unknown", done.answer.latency_s,
                                    done.answer.usage.completion_tokens)
            p.book.record_answer(ds, prompt, done.answer, done.attempts, done.seq,
                                 sampling=sampling_of(body) if ds.config.records_sampling else None)
            if done.answer.token_ids is None and self._wants_ids:
                self._no_ids(ds)
            if self.admission.duplicates is not None:
                self.admission.duplicates.answered(ds.config.name, prompt.id)
            req.book(Booked.answered(done.answer))
            await p.book.synced(ds)  # durable (group fsync) before the request finishes
        elif done.outcome is Outcome.FAILED:
            assert done.error is not None
            p.book.fail_or_doubt(ds, prompt, done.error, done.attempts, done.seq)
            req.book(Booked.failed(str(done.error.kind)))
            await p.book.synced(ds)
        elif done.outcome is Outcome.ACCOUNT:
            assert done.error is not None
            req.book(HANDED_BACK)
            self.watch.refused(done.error)
        elif done.outcome is Outcome.OVER_BUDGET:  # stays eligible: the next run (a higher max_usd) asks it again
            reason = "max_usd leaves no room for its retry"
            self.admission.skip_for_money(ds, prompt.id, reason)
            req.book(Booked.skipped(reason))
        elif done.outcome is Outcome.UNSENT:
            req.book(HANDED_BACK)
            p.control.hold(Hold.DISK, f"{done.disk_error}. The run is paused: a request is only sent once the spend "
                           "ledger has it on disk; free space and press r to resume (headless: kill -USR1 <pid>).")
        elif done.outcome is Outcome.DATASET:
            assert done.error is not None
            req.book(HANDED_BACK)
            if ds.stop_for(done.error, p.redact):
                p.event(snap.Level.ERROR, snap.EventKind.DATASET_STOPPED, f"{ds.config.name}: {ds.message}",
                        dataset=ds.config.name)
        else:  # GIVEN_UP: a drain or stop while retrying; it stays eligible
            req.book(HANDED_BACK)

    # -- the self-hosted server's token ids ---------------------------------------------------------

    @property
    def _wants_ids(self) -> bool:
        api = self._p.config.api
        return api.return_token_ids and api.self_hosted

    async def _server_ids(self) -> None:
        """Which server and release answer (asked once, if the start-up check did not), and an event
        saying how its ids are asked in this run's mode, or why they cannot be."""
        if not self._wants_ids:
            return
        api = self._p.config.api
        if not server_noted(api.base_url):
            await detect_server(self._p.config, self.attempts.client)
        asked, text = ids_plan(api.base_url, api.streams)
        self._ids_said = not asked  # the reason is said once, here: each answer without ids is still counted
        self._p.event(snap.Level.INFO if asked else snap.Level.WARN, snap.EventKind.SERVER_IDS, text)

    def _no_ids(self, ds: DatasetRun) -> None:
        """An answer without the ids asked for: counted (no_ids), and said once with the fix."""
        self._p.errors.add(ErrorKind.NO_IDS)
        if not self._ids_said:
            self._ids_said = True
            api = self._p.config.api
            self._p.event(snap.Level.WARN, snap.EventKind.SERVER_IDS, missing_ids_message(api.base_url, api.streams),
                          dataset=ds.config.name)

    # -- what the account watch tells the run ----------------------------------------------------

    def _key_refused(self, stop: AccountStop) -> None:
        alert = stop.alert(paused=False)
        self._p.control.say(alert)
        self._p.event(snap.Level.ERROR, snap.EventKind.ACCOUNT, alert)
        self._drain()

    def _account_cleared(self) -> None:
        if self._p.book.holding and not self._p.book.flush_held():
            return
        self._resume()
