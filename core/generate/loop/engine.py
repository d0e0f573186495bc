"""The generation engine: prompts in, answers on disk, at the configured concurrency, within budget.

The engine drives the run's lifecycle and its control surface (pause, resume, drain, stop); the work
is done by its parts, each in its own module:

    run_state.py   RunControl: the run's state, its holds and their reasons, the gate, how generation
                   ended (its final state, decided in RunControl.end; the ended line, the held outcome);
                   the run's end (label, exit code) is decided from it by core/run/life.py RunLife
    dataset_run.py a dataset's counts (answered + failed + skipped + left = total, asserted) and its files
    context.py     RunContext: the config, the gate, the event sink, clock and redactor every part reads
    parts.py       RunParts: the datasets, the money budget and ledger, the record book and what the run
                   opened (the client, the costs, the duplicates), handed down as one bundle
    run_loop.py    the account watch, the room, the service, the requests' terms and admission, built
                   once the run has opened
    admission.py   which prompt goes out when: each dataset's loop over its prompt source (source.py:
                   the file's prompts and those handed back), adaptive concurrency
    request.py     one request (`Request`) from its admission to its record, in one place: room for it
                   (room.py: slots, budgets), its reservation, attempts and retries (backoff, outages),
                   its outcome booked, recorded and told to its source; service.py: what the service
                   did for all of them (answers, faults, outages)
    duplicates.py  a prompt another dataset of the run directory answered is not sent again
    doubts.py      prompts set aside by a 4xx naming no known cause, until it is known whose it is
    record_book.py resume from disk, the record writer, the disk-full hold-back (spool_import.py:
                   what earlier runs spooled)
    spend.py       the money: every attempt on spend.jsonl, the sums behind the max_usd ceiling
                   (spend_file.py: the file, locked to one writer);
                   billing.py how each attempt's end is booked (who pays, how sure the figure is)
    prices.py      worst-case prices from the endpoints listing or the config; settle.py prices
                   abandoned generations from their records; account.py reads the balance, and
                   watch.py holds the run on an account condition until it clears
    opening.py     what a run reads and writes before its first request (run.json, the money)
    projection.py  the snapshot, made in one place: counts, projected cost, ETA (forecast.py: the
                   whole-run projection), with what the pipeline adds beside it

Each request ends in exactly one of: an answer line in responses.jsonl, a failure line in
failures.jsonl (a reason of the prompt's own), or nothing at all (stop now, an account or dataset
condition, a drain while retrying: the prompt stays eligible). Which, is decided by whose problem
each response is (classify.py).

Account conditions stop admission run-wide (requests in flight finish): a refused key (401) drains
the run, which ends with `key_refused` set; the others hold the run and re-read the account
(GET /key, GET /credits) every `api.credits_interval_s`, resuming when it shows room again; `r` or
SIGUSR1 resumes at once.

Answers the disk refused are held in memory (record_book.py) and never dropped: a drain waits for the disk,
retrying the write every HELD_RETRY_S (r / SIGUSR1 retry at once); stop now, or `spool_held()`, ends
the wait and the record book spools them to a fallback place (spool.py) that the next run imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from draftgen.core.config import Config
from draftgen.core.generate.api.account import AccountStop
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.fleet import FleetClient
from draftgen.core.generate.api.limits import ensure_open_files, tune_gc
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.opening import Opened, open_costs, open_datasets, write_run_json
from draftgen.core.generate.loop.parts import RunParts
from draftgen.core.generate.loop.projection import ALONE, Beside, EngineNow, Projector
from draftgen.core.generate.loop.record_book import RecordBook
from draftgen.core.generate.loop.run_loop import RunLoop
from draftgen.core.generate.loop.run_state import Hold, PausedBy, RunControl
from draftgen.core.generate.loop.stats import Tally
from draftgen.core.generate.money.budget import MoneyBudget, TokenBudget
from draftgen.core.generate.money.settle import Settler
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import payloads as ev
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import EventSink, Level, no_event
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.snapshot import RunState
from draftgen.core.live.stage_payloads import Draining, HeldWait, HeldWritten, RunDone, Stopping
from draftgen.core.private_dir import check_private
from draftgen.core.records import ResponseLine
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible
from draftgen.core.secrets import Redactor

HELD_RETRY_S = 3.0  # how often a run ending with answers held retries writing them

class Engine:
    def __init__(self, config: Config, api_key: str, *, on_event: EventSink | None = None,
                 on_answer: Callable[[str, ResponseLine], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                 rundir: RunDir | None = None, redact: Redactor | None = None) -> None:
        self.config = config
        self.rundir = rundir or RunDir(config.run_dir)  # the pipeline's (one per run), or the engine's own
        self._api_key = api_key
        self._redact = redact or Redactor(api_key, config.api.management_key())
        self._event: EventSink = on_event or no_event  # the pipeline's: it redacts what leaves for the views
        self._clock = clock
        self.datasets = {d.name: DatasetRun(d, TokenBudget(d.token_budget, d.max_tokens),
                                            AdaptiveConcurrency(d.concurrency, clock, self._limit_said(d.name)))
                         for d in config.datasets}
        self.spend = SpendLedger(self.rundir.spend)
        self.money = MoneyBudget(config.budget.max_usd, config.budget.credit_floor_usd, self.spend, clock)
        self.errors = Tally()
        self.provider_stats = ProviderStats(on_health=self._provider_said)
        self.recent = RecentErrors(providers=self.provider_stats)
        self.control = RunControl(self._event)  # the run's state, holds, gate and end: changed only through it
        self._started = clock()
        self._ended_at: float | None = None  # when the run ended: its elapsed time stops there
        self._ctx = RunContext(config, self.control, self._event, clock, self._redact, self.errors, self.recent,
                               self.provider_stats)  # what every part of the loop reads, passed once
        self.book = RecordBook(self._ctx, self.rundir, self.datasets, self.money, on_answer=on_answer)
        self._rng = random.Random(seed)
        self._opened: Opened | None = None  # what the run opened (the client, the costs, the duplicates)
        self._loop: RunLoop | None = None   # built, whole, once the run has opened what it needs
        self._projector = Projector(run_name=visible(self.rundir.root.name), model=config.api.model,
                                    parallel=config.engine.parallel, datasets=self.datasets.values(), book=self.book,
                                    money=self.money, recent=self.recent, provider_stats=self.provider_stats)
        self._spool_now = False                # end the wait for the disk: spool what is held
        self._held_wake = asyncio.Event()      # retry writing the held records now

    @property
    def in_flight(self) -> int:
        return sum(d.in_flight for d in self.datasets.values())

    @property
    def retries(self) -> int:
        return self._loop.service.retries if self._loop is not None else 0

    @property
    def backing_off(self) -> int:
        """Requests waiting out a transient error before their retry, now."""
        return self._loop.service.backing_off if self._loop is not None else 0

    @property
    def prices(self) -> dict[str, Prices | None]:
        """Each dataset's worst-case prices, once the run has read them (None: unknown)."""
        return self._opened.costs.prices if self._opened is not None else {}

    @property
    def settler(self) -> Settler | None:
        """Prices abandoned attempts, from when the run has opened its costs."""
        return self._opened.costs.settler if self._opened is not None else None

    @property
    def state(self) -> RunState:
        return self.control.state

    @property
    def alert(self) -> str:
        return self.control.alert

    @property
    def current_hold(self) -> Hold | None:
        """Why the engine paused the run by itself, while it is paused."""
        return self.control.current_hold

    @property
    def account(self) -> AccountStop | None:
        """The account condition holding the run, while it does."""
        return self.control.account

    @property
    def key_refused(self) -> AccountStop | None:
        """A 401 drained the run."""
        return self.control.key_refused

    @property
    def ended(self) -> str:
        """How the run ended, with counts (final states only)."""
        return self.control.ended

    # -- control surface ------------------------------------------------------------------------

    def pause(self, by: PausedBy = PausedBy.USER) -> None:
        self.control.pause(by)

    def resume(self) -> None:
        self._held_wake.set()  # a drain waiting for the disk retries at once
        if self.state != RunState.PAUSED:
            return
        if self.book.holding and not self.book.flush_held():
            return
        if self._loop is not None and self._loop.watch.balance_bound:
            # The balance we hold is from before the top-up: read it again before admitting.
            self.control.say("402: checking the balance before resuming")
            asyncio.get_running_loop().create_task(self._loop.watch.read_then(self._set_running))
            return
        self._set_running()

    def _set_running(self) -> None:
        self.control.resume()
        self._wake_all()

    def drain(self) -> None:
        """Admit nothing more; requests in flight finish and are recorded."""
        self.book.reading_stop.set()  # no prompt file is read further (a count, the next chunk)
        if not self.control.drain():
            return
        self._wake_all()
        self._event(Draining(in_flight=self.in_flight))

    def spool_held(self) -> None:
        """Stop waiting for the disk: the records held in memory go to the spool (spool.py) at the end."""
        self._spool_now = True
        self._held_wake.set()

    def stop(self) -> None:
        """Stop now: requests in flight are abandoned (not recorded; the next run asks them again); the
        records held in memory are spooled, never dropped."""
        self._held_wake.set()
        self.book.reading_stop.set()
        if not self.control.stop():
            return
        self._wake_all()
        tasks = tuple(self._loop.service.tasks) if self._loop is not None else ()
        for task in tasks:
            task.cancel()
        self._event(Stopping(abandoned=len(tasks)))

    # -- the run --------------------------------------------------------------------------------

    async def run(self, client: ChatClient | None = None) -> RunState:
        """Run every dataset; returns the final state (DONE or STOPPED)."""
        cfg = self.config
        parallel = cfg.engine.parallel
        need = (sum(d.concurrency for d in cfg.datasets) if parallel else max(d.concurrency for d in cfg.datasets))
        ensure_open_files(need)
        # The collector tuned before the opening too: with the default thresholds, reading the prompts and
        # the run's files (tens of thousands of objects kept) ran ~60 collections, a full one among them.
        tune_gc(need)
        check_private(self.rundir.root, cfg.path, shared=cfg.output.shared)
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        write_run_json(self.rundir, cfg)
        own_client = client is None
        client = client or self._client(need)
        if isinstance(client, FleetClient):  # each server's tallies and state in the snapshot
            self.provider_stats.servers = client.servers
            self.provider_stats.server_limits = client.limits
        client.open()
        try:
            costs = await open_costs(cfg, self.rundir, self.spend, client, self._event, on_settled=self._wake_all)
        except BaseException:
            if own_client:
                await client.close()
            self.spend.close()
            raise
        self.control.start()
        self._started = self._clock()
        try:  # from here what was opened (the ledger and its lock, the settler, the client) is closed
            # Answers an earlier run spooled are imported (as each dataset opens) before anything is sent.
            await asyncio.to_thread(self.book.load_spools)
            duplicates = await open_datasets(cfg, self.rundir, self.datasets, self.book, self.spend, costs.prices,
                                             self._event)
            self.book.finish_import()
            costs.settler.start_unknown()  # after the records on disk priced what they can
            self._opened = Opened(client, costs, duplicates)
            parts = RunParts(self.datasets, self.money, self.spend, self.book, self._opened)  # handed down whole
            self._loop = RunLoop(self._ctx, parts, rng=self._rng, drain=self.drain, resume=self._set_running)
            tune_gc(need)  # again: what the opening built (the prompts kept, the ids on disk) frozen out too
            await self._loop.run()
            await self._wait_for_disk()
        finally:
            # Abandoned attempts priced now if their records come quickly; the rest stay pending for
            # the next run (or `draftgen ledger`), counted at their worst case until then.
            try:
                try:
                    await costs.settler.drain(0.0 if self.control.stopping else
                                              min(10.0, self.config.api.generation_lookup_s))
                    if own_client:
                        await client.close()
                finally:  # held records written, spooled or said lost, even when the run is cancelled
                    self.book.settle_held()
                    self.book.close()
            finally:
                self.spend.close()  # and its lock: another run or smoke test may open it
                self._ended_at = self._clock()  # however it ended: its elapsed time stops here
        # How generation ended, with what is left: reported to RunControl, which decides its final state.
        self.control.end(self.datasets.values(), money_limited=self._loop is not None and self._loop.room.money_limited)
        self._event(RunDone(state=self.state.value, ended=self.ended, spent_run_usd=self.money.spent_run,
                            spent_usd=self.spend.spent_usd,
                            pending_usd=self.spend.pending_usd if self.spend.pending else None,
                            at=Level.INFO if self.state == RunState.DONE else Level.WARN))
        return self.state

    async def _wait_for_disk(self) -> None:
        """The run is over but answers are held in memory: retry writing them every HELD_RETRY_S until
        the disk takes them, stop now or `spool_held()` (then settle_held spools them)."""
        said = False
        while self.book.holding and not (self._spool_now or self.control.stopping):
            if self.book.flush_held():
                self._event(HeldWritten())
                return
            if not said:
                said = True
                self._event(HeldWait(answers=self.book.held_answers, retry_s=HELD_RETRY_S))
            self._held_wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that arrives as the
            # wake completes (a resume or spool in the turn the run is cancelled), and the loop went on
            # retrying a full disk with the cancelled run's exit held.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HELD_RETRY_S):
                    await self._held_wake.wait()

    def _wake_all(self) -> None:
        for ds in self.datasets.values():
            ds.wake.set()

    def _client(self, need: int) -> ChatClient:
        """The run's client: one base_url's, or a fleet's (a list of them, api/fleet.py), whose servers taken
        out and back are said as the run's events."""
        api = self.config.api
        kwargs: dict[str, Any] = dict(request_timeout_s=api.request_timeout_s, connect_timeout_s=api.connect_timeout_s,
                                      referer=api.referer, title=api.title, redact=self._redact,
                                      server=api.server)
        if not api.servers:
            return ChatClient(api.base_url, self._api_key, concurrency=need, **kwargs)

        def say(out: bool, text: str) -> None:  # a server taken out, or back
            self._event(ev.Unreachable(cause=text) if out else ev.Reachable(detail=text))

        clock = self._clock
        return FleetClient(api.servers, self._api_key, concurrency=need, say=say, say_limit=self._event,
                           limits=lambda share, said: AdaptiveConcurrency(share, clock, said), **kwargs)

    def _provider_said(self, bad: bool, message: str) -> None:
        """A provider gone bad, or back (recent.py `ProviderStats`): an event."""
        self._event(ev.Provider(detail=message, bad=bad))

    def _limit_said(self, name: str) -> Callable[[ev.Concurrency], None]:
        """What dataset `name`'s adaptive limit says (a storm's start and end, the limit back): an event."""
        return lambda change: self._event(dataclasses.replace(change, dataset=name))

    def waiting(self) -> str:
        """Why the run is making no progress right now, in a sentence (empty while it is)."""
        if self.book.holding and self.control.draining and not self.in_flight:
            return (f"{self.book.held_answers} paid answer(s) held in memory, not on disk: waiting for the disk "
                    f"(retried every {HELD_RETRY_S:g} s; r or kill -USR1 retries now; a second SIGINT spools them)")
        if self.state == RunState.PAUSED:
            if self.alert:
                return self.alert
            if self.control.paused_by is PausedBy.SMOKE:
                return "paused for the smoke test: the run resumes when it ends"
            return "paused by the user: r resumes (headless: kill -USR1 <pid>)"
        if self.state not in (RunState.RUNNING, RunState.DRAINING):
            return ""
        if self._loop is None:
            return ""
        return self._loop.service.stalled(self.in_flight) or self._loop.room.unknown_wait()

    # -- the picture ----------------------------------------------------------------------------

    def snapshot(self, beside: Beside = ALONE) -> snap.RunSnapshot:
        """The run's picture (projection.py), with what the pipeline's owners add `beside` it."""
        elapsed = (self._clock() if self._ended_at is None else self._ended_at) - self._started
        now = EngineNow(self.control.view(), self.waiting(), elapsed, self.retries, self.prices,
                        self._opened.costs.smoke if self._opened is not None else None)
        return self._projector.snapshot(now, beside)
