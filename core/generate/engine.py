"""The generation engine: prompts in, answers on disk, at the configured concurrency, within budget.

The engine owns the run's lifecycle and its control surface (pause, resume, drain, stop); the work
is done by its parts, each in its own module:

    admission.py   which prompt goes out when: adaptive concurrency, slots, budgets, the requeue
    duplicates.py  a prompt another dataset of the run directory answered is not sent again
    attempts.py    one prompt asked until it has an outcome: backoff, retries, outages
    ledger.py      per-dataset counts, resume from disk, the record writer, the disk-full hold-back
    spend.py       the money: every attempt on spend.jsonl, the sums behind the max_usd ceiling
    prices.py      worst-case prices from the endpoints listing or the config; settle.py prices
                   abandoned generations from their records; account.py reads the balance
    projection.py  the snapshot: counts, projected cost, ETA (forecast.py: the whole-run projection)

Each request ends in exactly one of: an answer line in responses.jsonl, a failure line in
failures.jsonl (a reason of the prompt's own), or nothing at all (stop now, an account or dataset
condition, a drain while retrying: the prompt stays eligible). Which, is decided by whose problem
each response is (classify.py).

Account conditions stop admission run-wide (requests in flight finish): a refused key (401) drains
the run, which ends with `key_refused` set; the others hold the run and re-read the account
(GET /key, GET /credits) every `api.credits_interval_s`, resuming when it shows room again; `r` or
SIGUSR1 resumes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import platform
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.admission import AdaptiveConcurrency, Admission, Gate, Hold
from draftgen.core.generate.attempts import Attempts, Outcome
from draftgen.core.generate.budget import MoneyBudget, TokenBudget
from draftgen.core.generate.account import AccountStatus, AccountStop, read_account
from draftgen.core.generate.classify import AccountCondition, RequestFailed
from draftgen.core.generate.client import ChatClient
from draftgen.core.generate.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.forecast import SmokeFigures
from draftgen.core.generate.ledger import DatasetRun, Ledger
from draftgen.core.generate.limits import ensure_open_files
from draftgen.core.generate.prices import fetch_prices, require_prices
from draftgen.core.generate.projection import project
from draftgen.core.generate.prompts import Prompt
from draftgen.core.generate.settle import Settler
from draftgen.core.generate.smoke import load_smoke_answer
from draftgen.core.generate.spend import SpendLedger, Ticket
from draftgen.core.generate.stats import Tally
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.summary import ended_line, final_state
from draftgen.core.live.snapshot import RunState
from draftgen.core.files import write_json_atomic
from draftgen.core.records import ErrorKind
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor


def tune_gc() -> None:
    """Keep collector pauses short with thousands of requests in flight: what exists before the
    run (modules, config, the UI) is frozen out of every collection, and young collections run
    less often, so the full ones (which stalled the loop for 100+ ms) come rarely."""
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 10_000), max(gen1, 20), max(gen2, 50))


class Engine:
    def __init__(self, config: Config, api_key: str, *, on_event: Callable[[str, str, str], None] | None = None,
                 on_answer: Callable[[str, dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self.config = config
        self.rundir = RunDir(config.run_dir)
        self._api_key = api_key
        self._redact = Redactor(api_key)
        self._on_event = on_event or (lambda level, kind, message: None)
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
        self.state = RunState.IDLE
        self.alert = ""
        self.ended = ""  # how the run ended, with counts (final states only)
        self.held: Hold | None = None  # why the engine paused the run by itself, while it is paused
        self.account: AccountStop | None = None  # the account condition holding the run, while it does
        self.key_refused: AccountStop | None = None  # a 401 drained the run
        self._recheck: asyncio.Task[None] | None = None
        self._account_status: AccountStatus | None = None  # the last read of GET /key and GET /credits
        self._started = clock()
        self._gate = Gate(asyncio.Event())
        self._gate.resume.set()
        self.ledger = Ledger(self.rundir, self.datasets, self.money, self.errors, self._redact,
                             on_event=self._event, on_hold=self._hold, on_answer=on_answer, clock=clock)
        self.admission = Admission(self.datasets, self.money, self._gate, self.ledger, self._request, self._event,
                                   on_floor=self._floor_hold,
                                   settling=lambda: self.settler.waiting if self.settler is not None else 0)
        self.attempts = Attempts(config, self._gate, self.errors, random.Random(seed),
                                 retry_slot=self.admission.retry_slot, reserve_retry=self.admission.reserve_retry,
                                 spend=self.spend, on_event=self._event, redact=self._redact, clock=clock,
                                 recent=self.recent)
        self._client: ChatClient | None = None
        self._seq = 0

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    @property
    def retries(self) -> int:
        return self.attempts.retries

    # -- control surface ------------------------------------------------------------------------

    def pause(self, reason: str = "") -> None:
        if self.state == RunState.RUNNING:
            self.state = RunState.PAUSED
            self._gate.resume.clear()
            self._event("info", "paused", f"paused{': ' + reason if reason else ''} "
                        "(requests in flight finish and are recorded)")

    def resume(self) -> None:
        if self.state != RunState.PAUSED:
            return
        if self.ledger.holding and not self.ledger.flush_held():
            return
        stop = self.account
        if stop is not None and stop.condition in (AccountCondition.OUT_OF_CREDITS, AccountCondition.CREDIT_FLOOR) \
                and self._client is not None:
            # The balance we hold is from before the top-up: read it again before admitting.
            self.alert = "402: checking the balance before resuming"
            asyncio.get_running_loop().create_task(self._resume_after_balance())
            return
        self._set_running()

    async def _resume_after_balance(self) -> None:
        try:
            await self._read_account()
        except Exception as e:  # resume anyway: the next 402 holds the run again
            self._event("warn", "credits", f"could not read the balance: {type(e).__name__}")
        if self.state == RunState.PAUSED:
            self._set_running()

    def _set_running(self) -> None:
        self.state = RunState.RUNNING
        self.alert = ""
        self.held = None
        self.account = None
        self._gate.resume.set()
        self.admission.wake_all()
        self._event("info", "resumed", "resumed")

    def drain(self) -> None:
        """Admit nothing more; requests in flight finish and are recorded."""
        if self.state in (RunState.DONE, RunState.STOPPED) or self._gate.draining:
            return
        self._gate.draining = True
        self.state = RunState.DRAINING
        self._gate.resume.set()
        self.admission.wake_all()
        self._event("info", "draining", f"draining: waiting for {self.in_flight} requests in flight")

    def stop(self) -> None:
        """Stop now: requests in flight are abandoned (not recorded; the next run asks them again)."""
        if self._gate.stopping:
            return
        self._gate.stopping = True
        self._gate.draining = True
        self._gate.resume.set()
        self.admission.wake_all()
        tasks = tuple(self.admission.tasks)
        for task in tasks:
            task.cancel()
        self._event("warn", "stopping", f"stopping now: {len(tasks)} requests in flight abandoned "
                    "(they stay eligible for the next run)")

    # -- the run --------------------------------------------------------------------------------

    async def run(self, client: ChatClient | None = None) -> RunState:
        """Run every dataset; returns the final state (DONE or STOPPED)."""
        cfg = self.config
        parallel = cfg.engine.parallel
        need = (sum(d.concurrency for d in cfg.datasets) if parallel else max(d.concurrency for d in cfg.datasets))
        ensure_open_files(need)
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        self._write_run_json()
        own_client = client is None
        self._client = client or ChatClient(
            cfg.api.base_url, self._api_key, concurrency=need, request_timeout_s=cfg.api.request_timeout_s,
            connect_timeout_s=cfg.api.connect_timeout_s, referer=cfg.api.referer, title=cfg.api.title)
        self._client.open()
        self.attempts.client = self._client
        try:
            await self._open_money()
        except BaseException:
            if own_client:
                await self._client.close()
            self.spend.close()
            raise
        self.state = RunState.RUNNING if self.state == RunState.IDLE else self.state
        self._started = self._clock()
        # Spend and answers already on disk count against the budgets from the start.
        for ds in self.datasets.values():
            await asyncio.to_thread(self.ledger.open, ds)
        if not self.spend.existed:  # a directory from before the spend ledger: its answers' cost carries in
            for ds in self.datasets.values():
                self.spend.carry(ds.config.name, ds.cost)
        # Every dataset's prompts counted now, so the projection covers those not started yet; a file
        # that cannot be read fails when its dataset starts, as before.
        for ds in self.datasets.values():
            with contextlib.suppress(DraftgenError):
                await asyncio.to_thread(self.ledger.scan_prompts, ds)
        if cfg.engine.skip_cross_dataset_duplicates:
            duplicates = CrossDatasetDuplicates()
            await asyncio.to_thread(duplicates.load, self.rundir.root, list(self.datasets))
            # One dataset: nothing to compare with, so no key is computed per prompt.
            self.admission.duplicates = duplicates if duplicates.needed else None
        tune_gc()
        ticker = asyncio.create_task(self.admission.grow_limits())
        credits = asyncio.create_task(self._watch_credits())
        try:
            if parallel:
                await asyncio.gather(*(self.admission.run(ds) for ds in self.datasets.values()))
            else:
                for ds in self.datasets.values():
                    await self.admission.run(ds)
        finally:
            ticker.cancel()
            credits.cancel()
            if self._recheck is not None:
                self._recheck.cancel()
            assert self.settler is not None
            # Abandoned attempts priced now if their records come quickly; the rest stay pending for
            # the next run (or `draftgen ledger`), counted at their worst case until then.
            await self.settler.drain(0.0 if self._gate.stopping else min(10.0, self.config.api.generation_lookup_s))
            if own_client:
                await self._client.close()
            self.ledger.settle_held()
            self.ledger.close()
            self.spend.close()
        # DONE only when every prompt has an outcome; otherwise how it ended, with what is left.
        self.state = final_state(self.datasets.values(), stopping=self._gate.stopping,
                                 draining=self._gate.draining, waiting=self.held is Hold.ACCOUNT)
        self.ended = ended_line(self.state, self.datasets.values())
        self._event("info" if self.state == RunState.DONE else "warn", "run_done",
                    f"run {self.ended}; ${self.money.spent_run:.4f} spent this run, ${self.spend.spent_usd:.4f} all runs"
                    + (f" (${self.spend.pending_usd:.4f} of it pending, at worst case)" if self.spend.pending else ""))
        return self.state

    def _write_run_json(self) -> None:
        import aiohttp

        from importlib.metadata import PackageNotFoundError, version
        try:
            dg_version = version("draftgen")
        except PackageNotFoundError:
            dg_version = "unknown"
        info = {"config": self.config.public_dict(), "config_file": str(self.config.path),
                "fingerprint": self.config.run_fingerprint(),
                "fingerprints": {d.name: self.config.fingerprint(d) for d in self.config.datasets},
                "versions": {"draftgen": dg_version, "python": platform.python_version(),
                             "aiohttp": aiohttp.__version__, "orjson": orjson.__version__},
                "started_at": time.time()}
        write_json_atomic(self.rundir.run_json, info)  # a full disk at the start: a clear message

    async def _open_money(self) -> None:
        """The spend ledger of every earlier run, the prices (refusing to start with a ceiling and no
        price), and the lookups of what earlier runs left pending."""
        assert self._client is not None
        cut = await asyncio.to_thread(self.spend.open)
        if cut:
            self._event("warn", "repaired", f"{self.spend.path}: cut a half-written last line ({cut} bytes)")
        prices, listing_error = await fetch_prices(self._client, self.config)
        require_prices(self.config, prices, listing_error)
        self.admission.prices = prices
        for name, p in prices.items():
            self._event("info", "prices", f"{name}: worst case {p.describe()}" if p is not None else
                        f"{name}: no price known ({listing_error or 'no provider allowed'}); no ceiling is set")
        self._smoke_answer = await asyncio.to_thread(load_smoke_answer, self.rundir, self.config.run_fingerprint())
        self.settler = Settler(self.spend, self._client, self.config.api.generation_lookup_s,
                               on_settled=self.admission.wake_all)
        self.attempts.settler = self.settler
        self.settler.start()
        left = self.spend.lookups()
        if self.spend.pending:
            self._event("warn", "pending", f"{len(self.spend.pending)} attempt(s) of earlier runs not priced yet "
                        f"count at their worst case (${self.spend.pending_usd:.4f}); {len(left)} looked up now")
        self.settler.add(left)

    async def _request(self, ds: DatasetRun, prompt: Prompt, ticket: Ticket) -> None:
        done = await self.attempts.ask(ds, self.config.request_body(ds.config, prompt.messages), ticket)
        if done.outcome is Outcome.ANSWERED:
            assert done.answer is not None
            self.provider_stats.answer(done.answer.provider or "unknown", done.answer.latency_s,
                                       done.answer.usage.completion_tokens)
            self.ledger.record_answer(ds, prompt, done.answer, done.attempts)
            if self.admission.duplicates is not None:
                self.admission.duplicates.answered(ds.config.name, prompt.id)
        elif done.outcome is Outcome.FAILED:
            assert done.error is not None
            self.ledger.record_failure(ds, prompt, done.error, done.attempts)
        elif done.outcome is Outcome.ACCOUNT:
            assert done.error is not None
            ds.requeue.append(prompt)
            self._account_stop(done.error)
        elif done.outcome is Outcome.OVER_BUDGET:
            ds.skipped += 1  # stays eligible: the next run (with a higher max_usd) asks it again
        elif done.outcome is Outcome.UNSENT:
            ds.requeue.append(prompt)
            self._hold(Hold.DISK, f"{done.disk_error}. The run is paused: a request is only sent once the spend "
                       "ledger has it on disk; free space and press r to resume (headless: kill -USR1 <pid>).")
        elif done.outcome is Outcome.DATASET:
            assert done.error is not None
            self._stop_dataset(ds, done.error)

    def _stop_dataset(self, ds: DatasetRun, e: RequestFailed) -> None:
        """The dataset's routing or settings refuse every prompt: it admits nothing more, its prompts stay
        eligible, the message says what to change."""
        if ds.stopped:
            return
        ds.stopped = True
        why = self._redact(e.message)[:300]
        todo = {ErrorKind.MAX_TOKENS_EXCEEDED: f"lower max_tokens (now {ds.config.max_tokens}) for this dataset",
                ErrorKind.WEIGHT_EXCEEDS_BUDGET: f"lower max_tokens (now {ds.config.max_tokens}) or add credits",
                ErrorKind.NOT_FOUND: "check [api] model",
                }.get(e.kind, "check the provider routing ([request] provider, the account's privacy settings)")
        ds.message = f"stopped: {why}; {todo}, then run again (its prompts stay eligible)"
        self._event("error", "dataset_stopped", f"{ds.config.name}: {ds.message}")
        ds.wake.set()

    def _floor_hold(self, reason: str) -> None:
        """The live balance reached credit_floor_usd: an account condition like a 402, met before it."""
        source = self._account_status.balance_detail if self._account_status is not None else "unknown"
        self._hold_account(AccountStop(AccountCondition.CREDIT_FLOOR, f"{reason}; balance from {source}"))

    def _account_stop(self, e: RequestFailed) -> None:
        """Stop admission run-wide for an account condition; nothing is failed."""
        condition = e.account or AccountCondition.FORBIDDEN
        self._hold_account(AccountStop.of(condition, self._redact(e.message)[:300], e.metadata))

    def _hold_account(self, stop: AccountStop) -> None:
        condition = stop.condition
        if condition is AccountCondition.KEY_REFUSED:
            if self.key_refused is None:
                self.key_refused = stop
                self.alert = stop.alert(paused=False)
                self._event("error", "account", self.alert)
                self.drain()
            return
        if self._gate.closed:
            return
        if self.account is not None and self.state == RunState.PAUSED:
            return  # already held (an answer in flight when it began)
        self.account = stop
        self._hold(Hold.ACCOUNT, stop.alert())
        if stop.recheck and (self._recheck is None or self._recheck.done()):
            self._recheck = asyncio.get_running_loop().create_task(self._recheck_account())

    async def _recheck_account(self) -> None:
        """While an account condition holds the run: read the account every credits interval, resume
        when it shows room again."""
        while self.account is not None and self.state == RunState.PAUSED and not self._gate.closed:
            await asyncio.sleep(self.config.api.credits_interval_s)
            stop = self.account
            if stop is None or self.state != RunState.PAUSED or self._gate.closed:
                return
            try:
                status = await self._read_account()
            except RequestFailed as e:
                if e.account is AccountCondition.KEY_REFUSED:
                    self._account_stop(e)
                    return
                continue  # the account cannot be read now: try again next interval
            except Exception:  # noqa: BLE001 - a re-check must never take the run down
                continue
            # Room for what is still reserved plus the worst case of the next request, as admission asks.
            need = self.spend.reserved_usd + self.admission.last_worst
            if stop.cleared_by(status, need_usd=need, floor_usd=self.money.floor_usd, now=time.time()):
                self._event("info", "account", f"{stop.condition.value} cleared ({status.balance_detail}): "
                            "resuming")
                if self.ledger.holding and not self.ledger.flush_held():
                    return
                self._set_running()
                return

    async def _read_account(self) -> AccountStatus:
        assert self._client is not None
        status = await read_account(self._client, management_key=self.config.api.management_key())
        first_unknown = status.balance is None and (self._account_status is None or
                                                    self._account_status.balance is not None)
        self._account_status = status
        self.money.set_balance(status.balance, status.balance_source)
        if status.balance is not None:
            self.admission.wake_all()
        elif first_unknown:
            self._event("warn", "credits", f"balance {self._redact(status.balance_detail)}; the run keeps going "
                        "under max_usd")
        return status

    def _hold(self, why: Hold, message: str) -> None:
        """The engine pauses the run by itself (out of credits, a write the disk refused)."""
        first = self.alert != message
        self.alert = message
        self.held = why
        if self.state == RunState.RUNNING:
            self.state = RunState.PAUSED
            self._gate.resume.clear()
        if first:
            self._event("error", "alert", message)

    def _event(self, level: str, kind: str, message: str) -> None:
        self._on_event(level, kind, self._redact(message))

    async def _watch_credits(self) -> None:
        while True:
            try:
                await self._read_account()
            except RequestFailed as e:
                self._event("warn", "credits", f"could not read the balance: {self._redact(e.message)}")
            except Exception as e:  # a balance check must never take the run down
                self._event("warn", "credits", f"could not read the balance: {type(e).__name__}")
            await asyncio.sleep(self.config.api.credits_interval_s)

    def waiting(self) -> str:
        """Why the run is making no progress right now, in a sentence (empty while it is)."""
        if self.state == RunState.PAUSED:
            return self.alert or "paused by the user: r resumes (headless: kill -USR1 <pid>)"
        if self.state not in (RunState.RUNNING, RunState.DRAINING):
            return ""
        since = self.attempts.unreachable_since
        if since is not None:
            return (f"{self.attempts.unreachable_cause or 'cannot reach ' + self.config.api.base_url} for "
                    f"{self._clock() - since:.0f} s; retrying until it answers (check [api] base_url), no prompt "
                    "is failed meanwhile")
        backing = self.attempts.backing_off
        last = self.attempts.last_transient
        if backing and backing >= self.in_flight and last is not None:
            wait = f", Retry-After {last.retry_after:g} s" if last.retry_after is not None else ""
            return (f"all {backing} requests in flight are backing off a transient error "
                    f"({last.kind}{wait}): {self._redact(last.message)[:120]}")
        return ""

    # -- the picture ----------------------------------------------------------------------------

    def snapshot(self) -> snap.RunSnapshot:
        self._seq += 1
        return project(run_name=self.rundir.root.name, model=self.config.api.model, state=self.state,
                       alert=self.alert, waiting=self.waiting(), elapsed_s=self._clock() - self._started, seq=self._seq,
                       datasets=self.datasets.values(), ledger=self.ledger, retries=self.attempts.retries,
                       money=self.money, prices=self.admission.prices, parallel=self.config.engine.parallel,
                       smoke=self._smoke_answer)
