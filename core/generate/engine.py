"""The generation engine: prompts in, answers on disk, at the configured concurrency, within budget.

The engine owns the run's lifecycle and its control surface (pause, resume, drain, stop); the work
is done by its parts, each in its own module:

    admission.py   which prompt goes out when: adaptive concurrency, slots, budgets, the requeue
    duplicates.py  a prompt another dataset of the run directory answered is not sent again
    attempts.py    one prompt asked until it has an outcome: backoff, retries, outages
    doubts.py      prompts set aside by a 4xx naming no known cause, until it is known whose it is
    ledger.py      per-dataset counts, resume from disk, the record writer, the disk-full hold-back
    spend.py       the money: every attempt on spend.jsonl, the sums behind the max_usd ceiling
                   (spend_file.py: the file, locked to one writer);
                   billing.py how each attempt's end is booked (who pays, how sure the figure is)
    prices.py      worst-case prices from the endpoints listing or the config; settle.py prices
                   abandoned generations from their records; account.py reads the balance, and
                   watch.py holds the run on an account condition until it clears
    opening.py     what a run reads and writes before its first request (run.json, the money)
    projection.py  the snapshot: counts, projected cost, ETA (forecast.py: the whole-run projection)

Each request ends in exactly one of: an answer line in responses.jsonl, a failure line in
failures.jsonl (a reason of the prompt's own), or nothing at all (stop now, an account or dataset
condition, a drain while retrying: the prompt stays eligible). Which, is decided by whose problem
each response is (classify.py).

Account conditions stop admission run-wide (requests in flight finish): a refused key (401) drains
the run, which ends with `key_refused` set; the others hold the run and re-read the account
(GET /key, GET /credits) every `api.credits_interval_s`, resuming when it shows room again; `r` or
SIGUSR1 resumes at once.

Answers the disk refused are held in memory (ledger.py) and never dropped: a drain waits for the disk,
retrying the write every HELD_RETRY_S (r / SIGUSR1 retry at once); stop now, or `spool_held()`, ends
the wait and the ledger spools them to a fallback place (spool.py) that the next run imports.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from draftgen.core.config import Config
from draftgen.core.generate.admission import AdaptiveConcurrency, Admission
from draftgen.core.generate.attempts import Attempts, Outcome
from draftgen.core.generate.budget import MoneyBudget, TokenBudget
from draftgen.core.generate.account import AccountStop
from draftgen.core.generate.client import ChatClient
from draftgen.core.generate.forecast import SmokeFigures
from draftgen.core.generate.dataset_run import DatasetRun
from draftgen.core.generate.ledger import Ledger
from draftgen.core.generate.limits import ensure_open_files, tune_gc
from draftgen.core.generate.opening import open_datasets, open_money, write_run_json
from draftgen.core.generate.projection import project
from draftgen.core.generate.prompts import Prompt
from draftgen.core.generate.run_state import Hold, RunControl
from draftgen.core.generate.settle import Settler
from draftgen.core.generate.spend import SpendLedger, Ticket
from draftgen.core.generate.stats import Tally
from draftgen.core.generate.watch import AccountWatch
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.summary import ended_line, final_state
from draftgen.core.live.snapshot import RunState
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor
from draftgen.core.units import usd

HELD_RETRY_S = 3.0  # how often a run ending with answers held retries writing them

class Engine:
    def __init__(self, config: Config, api_key: str, *, on_event: snap.EventSink | None = None,
                 on_answer: Callable[[str, dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self.config = config
        self.rundir = RunDir(config.run_dir)
        self._api_key = api_key
        self._redact = Redactor(api_key, config.api.management_key())
        self._on_event = snap.event_sink(on_event)
        self._clock = clock
        self.datasets = {d.name: DatasetRun(d, TokenBudget(d.token_budget, d.max_tokens),
                                            AdaptiveConcurrency(d.concurrency, clock))
                         for d in config.datasets}
        self.spend = SpendLedger(self.rundir.spend)
        self.money = MoneyBudget(config.budget.max_usd, config.budget.credit_floor_usd, self.spend, clock)
        self.settler: Settler | None = None
        self._smoke_answer: SmokeFigures | None = None
        self.errors = Tally()
        self.provider_stats = ProviderStats()
        self.recent = RecentErrors(providers=self.provider_stats)
        self.control = RunControl(self._event)  # the run's state, holds and gate: changed only through it
        self.ended = ""  # how the run ended, with counts (final states only)
        self._started = clock()
        self.ledger = Ledger(self.rundir, self.datasets, self.money, self.errors, self._redact,
                             on_event=self._event, on_hold=self.control.hold, on_answer=on_answer, clock=clock)
        self.admission = Admission(self.datasets, self.money, self.control, self.ledger, self._request, self._event,
                                   on_floor=lambda reason: self.watch.floor_reached(reason),
                                   settling=lambda: self.settler.waiting if self.settler is not None else 0,
                                   body=config.request_body)
        self.attempts = Attempts(config, self.control, self.errors, random.Random(seed),
                                 retry_slot=self.admission.retry_slot, reserve_retry=self.admission.reserve_retry,
                                 spend=self.spend, on_event=self._event, redact=self._redact, clock=clock,
                                 recent=self.recent)
        self.watch = AccountWatch(config, self.money, self.spend, self.admission, self.control, self._redact, self._event,
                                  on_key_refused=self._key_refused, on_cleared=self._account_cleared)
        self._client: ChatClient | None = None
        self._seq = 0
        self._spool_now = False                # end the wait for the disk: spool what is held
        self._held_wake = asyncio.Event()      # retry writing the held records now

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    @property
    def retries(self) -> int:
        return self.attempts.retries

    @property
    def state(self) -> RunState:
        return self.control.state

    @property
    def alert(self) -> str:
        return self.control.alert

    @property
    def held(self) -> Hold | None:
        """Why the engine paused the run by itself, while it is paused."""
        return self.control.held

    @property
    def account(self) -> AccountStop | None:
        """The account condition holding the run, while it does."""
        return self.control.account

    @property
    def key_refused(self) -> AccountStop | None:
        """A 401 drained the run."""
        return self.watch.key_refused

    # -- control surface ------------------------------------------------------------------------

    def pause(self, by: str = "") -> None:
        self.control.pause(by)

    def resume(self) -> None:
        self._held_wake.set()  # a drain waiting for the disk retries at once
        if self.state != RunState.PAUSED:
            return
        if self.ledger.holding and not self.ledger.flush_held():
            return
        if self.watch.balance_bound and self._client is not None:
            # The balance we hold is from before the top-up: read it again before admitting.
            self.control.say("402: checking the balance before resuming")
            asyncio.get_running_loop().create_task(self.watch.read_then(self._set_running))
            return
        self._set_running()

    def _set_running(self) -> None:
        self.control.resume()
        self.admission.wake_all()

    def drain(self) -> None:
        """Admit nothing more; requests in flight finish and are recorded."""
        if not self.control.drain():
            return
        self.admission.wake_all()
        self._event(snap.Level.INFO, snap.EventKind.DRAINING,
                    f"draining: waiting for {self.in_flight} requests in flight")

    def spool_held(self) -> None:
        """Stop waiting for the disk: the records held in memory go to the spool (spool.py) at the end."""
        self._spool_now = True
        self._held_wake.set()

    def stop(self) -> None:
        """Stop now: requests in flight are abandoned (not recorded; the next run asks them again); the
        records held in memory are spooled, never dropped."""
        self._held_wake.set()
        if not self.control.stop():
            return
        self.admission.wake_all()
        tasks = tuple(self.admission.tasks)
        for task in tasks:
            task.cancel()
        self._event(snap.Level.WARN, snap.EventKind.STOPPING,
                    f"stopping now: {len(tasks)} requests in flight abandoned "
                    "(they stay eligible for the next run)")

    # -- the run --------------------------------------------------------------------------------

    async def run(self, client: ChatClient | None = None) -> RunState:
        """Run every dataset; returns the final state (DONE or STOPPED)."""
        cfg = self.config
        parallel = cfg.engine.parallel
        need = (sum(d.concurrency for d in cfg.datasets) if parallel else max(d.concurrency for d in cfg.datasets))
        ensure_open_files(need)
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        write_run_json(self.rundir, cfg)
        own_client = client is None
        self._client = client or ChatClient(
            cfg.api.base_url, self._api_key, concurrency=need, request_timeout_s=cfg.api.request_timeout_s,
            connect_timeout_s=cfg.api.connect_timeout_s, referer=cfg.api.referer, title=cfg.api.title)
        self._client.open()
        self.attempts.client = self.watch.client = self._client
        try:
            money = await open_money(cfg, self.rundir, self.spend, self._client, self._event,
                                     on_settled=self.admission.wake_all)
        except BaseException:
            if own_client:
                await self._client.close()
            self.spend.close()
            raise
        self.admission.prices = self.attempts.prices = money.prices
        self._smoke_answer = money.smoke
        self.settler = self.attempts.settler = money.settler
        self.control.start()
        self._started = self._clock()
        beside: list[asyncio.Task[None]] = []  # the limit growth and the account watch
        try:  # from here what was opened (the ledger and its lock, the settler, the client) is closed
            # Answers an earlier run spooled are imported (as each dataset opens) before anything is sent.
            await asyncio.to_thread(self.ledger.load_spools)
            self.admission.duplicates = await open_datasets(cfg, self.rundir, self.datasets, self.ledger, self.spend,
                                                             money.prices, self._event)
            self.ledger.finish_import()
            tune_gc()
            beside = [asyncio.create_task(self.admission.grow_limits()), asyncio.create_task(self.watch.watch())]
            if parallel:
                await asyncio.gather(*(self.admission.run(ds) for ds in self.datasets.values()))
            else:
                for ds in self.datasets.values():
                    await self.admission.run(ds)
            await self._wait_for_disk()
        finally:
            for task in beside:
                task.cancel()
            self.watch.cancel()
            assert self.settler is not None
            # Abandoned attempts priced now if their records come quickly; the rest stay pending for
            # the next run (or `draftgen ledger`), counted at their worst case until then.
            try:
                try:
                    await self.settler.drain(0.0 if self.control.stopping else
                                             min(10.0, self.config.api.generation_lookup_s))
                    if own_client:
                        await self._client.close()
                finally:  # held records written, spooled or said lost, even when the run is cancelled
                    self.ledger.settle_held()
                    self.ledger.close()
            finally:
                self.spend.close()  # and its lock: another run or smoke test may open it
        # DONE only when every prompt has an outcome; otherwise how it ended, with what is left.
        self.control.end(final_state(self.datasets.values(), stopping=self.control.stopping,
                                     draining=self.control.draining, waiting=self.held is Hold.ACCOUNT,
                                     money_limited=self.admission.money_limited))
        self.ended = ended_line(self.state, self.datasets.values())
        self._event(snap.Level.INFO if self.state == RunState.DONE else snap.Level.WARN, snap.EventKind.RUN_DONE,
                    f"run {self.ended}; {usd(self.money.spent_run)} spent this run, {usd(self.spend.spent_usd)} all runs"
                    + (f" ({usd(self.spend.pending_usd)} of it pending, at worst case)" if self.spend.pending else ""))
        return self.state

    async def _wait_for_disk(self) -> None:
        """The run is over but answers are held in memory: retry writing them every HELD_RETRY_S until
        the disk takes them, stop now or `spool_held()` (then settle_held spools them)."""
        said = False
        while self.ledger.holding and not (self._spool_now or self.control.stopping):
            if self.ledger.flush_held():
                self._event(snap.Level.INFO, snap.EventKind.HELD_WRITTEN,
                            "the disk took the held records: every answer is on disk")
                return
            if not said:
                said = True
                self._event(snap.Level.WARN, snap.EventKind.HELD_WAIT,
                            f"{self.ledger.held_answers} paid answer(s) are held in memory, not "
                            f"on disk: the run waits for the disk, retrying every {HELD_RETRY_S:g} s (free space; r "
                            "or SIGUSR1 retries now); quit again (a second SIGINT) to spool them to a fallback file")
            self._held_wake.clear()
            try:
                await asyncio.wait_for(self._held_wake.wait(), HELD_RETRY_S)
            except asyncio.TimeoutError:
                pass

    async def _request(self, ds: DatasetRun, prompt: Prompt, ticket: Ticket, body: dict[str, Any]) -> None:
        done = await self.attempts.ask(ds, body, ticket)  # the body the ticket reserved for
        if done.outcome is Outcome.ANSWERED:
            assert done.answer is not None
            self.provider_stats.answer(done.answer.provider or "unknown", done.answer.latency_s,
                                       done.answer.usage.completion_tokens)
            self.ledger.record_answer(ds, prompt, done.answer, done.attempts, done.seq)
            if self.admission.duplicates is not None:
                self.admission.duplicates.answered(ds.config.name, prompt.id)
            await self.ledger.synced(ds)  # durable (group fsync) before the request finishes
        elif done.outcome is Outcome.FAILED:
            assert done.error is not None
            self.ledger.fail_or_doubt(ds, prompt, done.error, done.attempts, done.seq)
            await self.ledger.synced(ds)
        elif done.outcome is Outcome.ACCOUNT:
            assert done.error is not None
            ds.requeued(prompt)
            self.watch.refused(done.error)
        elif done.outcome is Outcome.OVER_BUDGET:  # stays eligible: the next run (a higher max_usd) asks it again
            self.admission.skip_for_money(ds, prompt.id, "max_usd leaves no room for its retry")
        elif done.outcome is Outcome.UNSENT:
            ds.requeued(prompt)
            self.control.hold(Hold.DISK, f"{done.disk_error}. The run is paused: a request is only sent once the spend "
                       "ledger has it on disk; free space and press r to resume (headless: kill -USR1 <pid>).")
        elif done.outcome is Outcome.DATASET:
            assert done.error is not None
            if ds.stop_for(done.error, self._redact):
                self._event(snap.Level.ERROR, snap.EventKind.DATASET_STOPPED,
                            f"{ds.config.name}: {ds.message}",
                            dataset=ds.config.name)

    # -- what the account watch tells the engine --------------------------------------------------

    def _key_refused(self, stop: AccountStop) -> None:
        self.control.say(stop.alert(paused=False))
        self._event(snap.Level.ERROR, snap.EventKind.ACCOUNT, self.alert)
        self.drain()

    def _account_cleared(self) -> None:
        if self.ledger.holding and not self.ledger.flush_held():
            return
        self._set_running()

    def _event(self, level: snap.Level, kind: snap.EventKind, message: str, dataset: str = "") -> None:
        self._on_event(level, kind, self._redact(message), dataset=dataset)

    def waiting(self) -> str:
        """Why the run is making no progress right now, in a sentence (empty while it is)."""
        if self.ledger.holding and self.control.draining and not self.in_flight:
            return (f"{self.ledger.held_answers} paid answer(s) held in memory, not on disk: waiting for the disk "
                    f"(retried every {HELD_RETRY_S:g} s; r or kill -USR1 retries now; a second SIGINT spools them)")
        if self.state == RunState.PAUSED:
            return self.alert or "paused by the user: r resumes (headless: kill -USR1 <pid>)"
        if self.state not in (RunState.RUNNING, RunState.DRAINING):
            return ""
        return self.attempts.stalled(self.in_flight)

    # -- the picture ----------------------------------------------------------------------------

    def snapshot(self) -> snap.RunSnapshot:
        self._seq += 1
        return project(run_name=self.rundir.root.name, model=self.config.api.model, state=self.state,
                       alert=self.alert, waiting=self.waiting(), elapsed_s=self._clock() - self._started, seq=self._seq,
                       datasets=self.datasets.values(), ledger=self.ledger, retries=self.attempts.retries,
                       money=self.money, prices=self.admission.prices, parallel=self.config.engine.parallel,
                       smoke=self._smoke_answer)
