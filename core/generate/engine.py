"""The generation engine: prompts in, answers on disk, at the configured concurrency, within budget.

The engine owns the run's lifecycle and its control surface (pause, resume, drain, stop); the work
is done by its parts, each in its own module:

    admission.py   which prompt goes out when: adaptive concurrency, slots, budgets, the requeue
    duplicates.py  a prompt another dataset of the run directory answered is not sent again
    attempts.py    one prompt asked until it has an outcome: backoff, retries, outages
    ledger.py      per-dataset counts, resume from disk, the record writer, the disk-full hold-back
    projection.py  the snapshot: counts, projected cost, ETA

Each request ends in exactly one of: an answer line in responses.jsonl, a failure line in
failures.jsonl, or nothing at all (stop now, 402, 404 "no endpoints", a drain while the API cannot
be reached: the prompt stays eligible).
"""

from __future__ import annotations

import asyncio
import gc
import platform
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from draftgen.core.config import Config
from draftgen.core.generate.admission import AdaptiveConcurrency, Admission, Gate, Hold
from draftgen.core.generate.attempts import Attempts, Outcome
from draftgen.core.generate.budget import MoneyBudget, TokenBudget
from draftgen.core.generate.client import ChatClient, RequestFailed
from draftgen.core.generate.duplicates import CrossDatasetDuplicates
from draftgen.core.generate.ledger import DatasetRun, Ledger
from draftgen.core.generate.limits import ensure_open_files
from draftgen.core.generate.projection import project
from draftgen.core.generate.prompts import Prompt
from draftgen.core.generate.stats import Tally
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.summary import ended_line, final_state
from draftgen.core.live.snapshot import RunState
from draftgen.core.files import write_json_atomic
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
        self.money = MoneyBudget(config.budget.max_usd, config.budget.credit_floor_usd, clock)
        self.errors = Tally()
        self.provider_stats = ProviderStats()
        self.recent = RecentErrors(providers=self.provider_stats)
        self.state = RunState.IDLE
        self.alert = ""
        self.ended = ""  # how the run ended, with counts (final states only)
        self.held: Hold | None = None  # why the engine paused the run by itself, while it is paused
        self._started = clock()
        self._gate = Gate(asyncio.Event())
        self._gate.resume.set()
        self.ledger = Ledger(self.rundir, self.datasets, self.money, self.errors, self._redact,
                             on_event=self._event, on_hold=self._hold, on_answer=on_answer, clock=clock)
        self.admission = Admission(self.datasets, self.money, self._gate, self.ledger, self._request, self._event)
        self.attempts = Attempts(config, self._gate, self.errors, random.Random(seed),
                                 retry_slot=self.admission.retry_slot, on_event=self._event,
                                 redact=self._redact, clock=clock, recent=self.recent)
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
        if self.held is Hold.OUT_OF_CREDITS and self._client is not None:
            # The balance we hold is from before the top-up: read it again before admitting.
            self.alert = "402: checking the balance before resuming"
            asyncio.get_running_loop().create_task(self._resume_after_balance())
            return
        self._set_running()

    async def _resume_after_balance(self) -> None:
        assert self._client is not None
        try:
            balance = await asyncio.wait_for(self._client.balance(), 30)
            if balance is not None:
                self.money.set_balance(balance)
        except Exception as e:  # resume anyway: the next 402 pauses again
            self._event("warn", "credits", f"could not read the balance: {type(e).__name__}")
        self._set_running()

    def _set_running(self) -> None:
        self.state = RunState.RUNNING
        self.alert = ""
        self.held = None
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
        self.state = RunState.RUNNING if self.state == RunState.IDLE else self.state
        self._started = self._clock()
        # Spend and answers already on disk count against the budgets from the start.
        for ds in self.datasets.values():
            await asyncio.to_thread(self.ledger.open, ds)
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
            if own_client:
                await self._client.close()
            self.ledger.settle_held()
            self.ledger.close()
        # DONE only when every prompt has an outcome; otherwise how it ended, with what is left.
        self.state = final_state(self.datasets.values(), stopping=self._gate.stopping,
                                 draining=self._gate.draining, waiting=self.held is Hold.OUT_OF_CREDITS)
        self.ended = ended_line(self.state, self.datasets.values())
        self._event("info" if self.state == RunState.DONE else "warn", "run_done",
                    f"run {self.ended}; ${self.money.spent_run:.4f} spent this run")
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

    async def _request(self, ds: DatasetRun, prompt: Prompt) -> None:
        done = await self.attempts.ask(ds, self.config.request_body(ds.config, prompt.messages), prompt.id)
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
        elif done.outcome is Outcome.OUT_OF_CREDITS:
            ds.requeue.append(prompt)
            self._hold(Hold.OUT_OF_CREDITS, "402 Payment Required: out of credits. The run is paused; add "
                       "credits and press r to resume (headless: kill -USR1 <pid>).")
        elif done.outcome is Outcome.NO_ENDPOINTS and not ds.stopped:
            assert done.error is not None
            ds.stopped = True
            ds.message = f"no endpoints: {self._redact(done.error.message)[:200]}"
            self._event("error", "no_endpoints", f"{ds.config.name}: stopped: provider routing "
                        f"excludes every provider: {self._redact(done.error.message)}")

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
        assert self._client is not None
        while True:
            try:
                balance = await self._client.balance()
                if balance is not None:
                    self.money.set_balance(balance)
                    self.admission.wake_all()
            except RequestFailed as e:
                self._event("warn", "credits", f"could not read the balance: {self._redact(e.message)}")
            except Exception as e:  # a balance check must never take the run down
                self._event("warn", "credits", f"could not read the balance: {type(e).__name__}")
            await asyncio.sleep(self.config.api.credits_interval_s)

    # -- the picture ----------------------------------------------------------------------------

    def snapshot(self) -> snap.RunSnapshot:
        self._seq += 1
        return project(run_name=self.rundir.root.name, model=self.config.api.model, state=self.state,
                       alert=self.alert, elapsed_s=self._clock() - self._started, seq=self._seq,
                       datasets=self.datasets.values(), ledger=self.ledger, retries=self.attempts.retries)
