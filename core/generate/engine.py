"""The generation engine: prompts in, answers on disk, at the configured concurrency, within budget.

Per dataset an admission loop streams the prompt file, skips ids already on disk, and admits a
request when the run is not paused, a concurrency slot is free and the budgets allow it. Each
request task retries what SPEC.md says to retry (exponential backoff with full jitter, honouring
Retry-After) and ends in exactly one of: an answer line in responses.jsonl, a failure line in
failures.jsonl, or nothing at all (stop now, 402, 404 "no endpoints", a drain while the API cannot
be reached: the prompt stays eligible). An API that cannot be reached at all spends no attempt: the
request waits the outage out. An answer counts as acknowledged once its line is written and flushed.
"""

from __future__ import annotations

import asyncio
import gc
import math
import platform
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from draftgen.core.live import snapshot as snap
from draftgen.core.generate.budget import MoneyBudget, TokenBudget
from draftgen.core.generate.client import ChatAnswer, ChatClient, RequestFailed
from draftgen.core.config import Config, DatasetConfig
from draftgen.core.errors import DiskError
from draftgen.core.generate.limits import ensure_open_files
from draftgen.core.generate.prompts import Prompt, Rejection, read_prompts
from draftgen.core.rundir import JsonlAppender, RunDir, disk_error, iter_jsonl
from draftgen.core.secrets import Redactor
from draftgen.core.generate.stats import RateTracker, Tally

PROMPT_CHUNK = 512
ADMIT_BURST = 64  # admissions between yields to the event loop (2,000 at once would stall it)


class AdaptiveConcurrency:
    """AIMD on sustained 429s: three or more within 2 s that are also at least 5% of the responses
    in those 2 s cut the limit by 30% (at most every 2 s) — a background trickle of 429s at a high
    request rate is not a storm; 5 s without a 429 lets it grow back by 2% of the configured value
    per second."""

    WINDOW_S = 2.0
    MIN_429 = 3
    MIN_SHARE = 0.05

    def __init__(self, configured: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = configured
        self.effective = float(configured)
        self._clock = clock
        self._recent: deque[float] = deque()      # times of 429s in the window
        self._responses: deque[float] = deque()   # times of every response in the window
        self._last_cut = -1e9
        self._last_429 = -1e9

    @property
    def limit(self) -> int:
        return max(1, int(self.effective))

    def _prune(self, now: float) -> None:
        for q in (self._recent, self._responses):
            while q and now - q[0] >= self.WINDOW_S:
                q.popleft()

    def on_response(self) -> None:
        """Any answer or error other than a 429 (the share's denominator)."""
        now = self._clock()
        self._responses.append(now)
        if len(self._responses) > 4096:
            self._prune(now)

    def on_429(self) -> None:
        now = self._clock()
        self._last_429 = now
        self._recent.append(now)
        self._responses.append(now)
        self._prune(now)
        share = len(self._recent) / len(self._responses)
        if len(self._recent) >= self.MIN_429 and share >= self.MIN_SHARE and now - self._last_cut >= 2.0:
            self.effective = max(1.0, self.effective * 0.7)
            self._last_cut = now
            self._recent.clear()

    def tick(self) -> bool:
        """Called every second; True when the limit grew."""
        now = self._clock()
        if self.effective < self.configured and now - self._last_429 >= 5.0:
            self.effective = min(float(self.configured), self.effective + max(1.0, self.configured * 0.02))
            return True
        return False


@dataclass
class DatasetRun:
    config: DatasetConfig
    tokens: TokenBudget
    concurrency: AdaptiveConcurrency
    status: str = snap.DS_PENDING
    total: int = 0
    done: int = 0
    failed: int = 0
    skipped: int = 0
    rejected: int = 0
    truncated: int = 0
    in_flight: int = 0
    parked: int = 0            # of those, retries waiting for a slot under a lowered limit
    cost: float = 0.0
    message: str = ""
    done_ids: set[str] = field(default_factory=set)
    requeue: list[Prompt] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: bool = False      # 404 "no endpoints": admit nothing more
    responses: JsonlAppender | None = None
    failures: JsonlAppender | None = None


def tune_gc() -> None:
    """Keep collector pauses short with thousands of requests in flight: what exists before the
    run (modules, config, the UI) is frozen out of every collection, and young collections run
    less often, so the full ones (which stalled the loop for 100+ ms) come rarely."""
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 10_000), max(gen1, 20), max(gen2, 50))


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None,
                  rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt-1))]), never shorter than Retry-After."""
    delay = rng.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap * 5))
    return delay


class Engine:
    def __init__(self, config: Config, api_key: str, *, on_event: Callable[[str, str, str], None] | None = None,
                 on_answer: Callable[[str, dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self.config = config
        self.rundir = RunDir(config.run_dir)
        self._api_key = api_key
        self._redact = Redactor(api_key)
        self._on_event = on_event or (lambda level, kind, message: None)
        self._on_answer = on_answer
        self._clock = clock
        self._rng = random.Random(seed)
        self.datasets = {d.name: DatasetRun(d, TokenBudget(d.token_budget, d.max_tokens),
                                            AdaptiveConcurrency(d.concurrency, clock))
                         for d in config.datasets}
        self.money = MoneyBudget(config.budget.max_usd, config.budget.credit_floor_usd, clock)
        self.rates = RateTracker(clock=clock)
        self.errors = Tally()
        self.providers = Tally()
        self.retries = 0
        self.state = snap.IDLE
        self.alert = ""
        self._started = clock()
        self._resume = asyncio.Event()
        self._resume.set()
        self._draining = False
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending_writes: list[tuple[JsonlAppender, dict[str, Any]]] = []
        self._client: ChatClient | None = None
        self._seq = 0
        self._unreachable_since: float | None = None  # the API could not be reached; reset by an answer

    # -- control surface ------------------------------------------------------------------------

    def pause(self, reason: str = "") -> None:
        if self.state in (snap.RUNNING,):
            self.state = snap.PAUSED
            self._resume.clear()
            self._event("info", "paused", f"paused{': ' + reason if reason else ''} "
                        "(requests in flight finish and are recorded)")

    def resume(self) -> None:
        if self.state != snap.PAUSED:
            return
        if self._pending_writes and not self._flush_pending():
            return
        if self.alert.startswith("402") and self._client is not None:
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
        self.state = snap.RUNNING
        self.alert = ""
        self._resume.set()
        self._wake_all()
        self._event("info", "resumed", "resumed")

    def drain(self) -> None:
        """Admit nothing more; requests in flight finish and are recorded."""
        if self.state in (snap.DONE, snap.STOPPED) or self._draining:
            return
        self._draining = True
        self.state = snap.DRAINING
        self._resume.set()
        self._wake_all()
        self._event("info", "draining", f"draining: waiting for {self.in_flight} requests in flight")

    def stop(self) -> None:
        """Stop now: requests in flight are abandoned (not recorded; the next run asks them again)."""
        if self._stopping:
            return
        self._stopping = True
        self._draining = True
        self._resume.set()
        self._wake_all()
        for task in tuple(self._tasks):
            task.cancel()
        self._event("warn", "stopping", f"stopping now: {len(self._tasks)} requests in flight abandoned "
                    "(they stay eligible for the next run)")

    @property
    def in_flight(self) -> int:
        return sum(d.in_flight for d in self.datasets.values())

    # -- the run --------------------------------------------------------------------------------

    async def run(self, client: ChatClient | None = None) -> str:
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
        self.state = snap.RUNNING if self.state == snap.IDLE else self.state
        self._started = self._clock()
        # Spend and answers already on disk count against the budgets from the start.
        for ds in self.datasets.values():
            await asyncio.to_thread(self._load_done, ds)
        tune_gc()
        ticker = asyncio.create_task(self._tick())
        credits = asyncio.create_task(self._watch_credits())
        try:
            if parallel:
                await asyncio.gather(*(self._run_dataset(ds) for ds in self.datasets.values()))
            else:
                for ds in self.datasets.values():
                    await self._run_dataset(ds)
        finally:
            ticker.cancel()
            credits.cancel()
            if own_client:
                await self._client.close()
            self._settle_pending()
            for ds in self.datasets.values():
                for f in (ds.responses, ds.failures):
                    if f is not None:
                        f.close()
        self.state = snap.STOPPED if self._stopping else snap.DONE
        done = sum(d.done for d in self.datasets.values())
        self._event("info", "run_done", f"run {self.state.lower()}: {done} answered, "
                    f"{sum(d.failed for d in self.datasets.values())} failed, "
                    f"{sum(d.skipped for d in self.datasets.values())} skipped, "
                    f"${self.money.spent_run:.4f} spent this run")
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
        tmp = self.rundir.run_json.with_suffix(".json.tmp")
        try:
            tmp.write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
            tmp.replace(self.rundir.run_json)
        except OSError as e:  # a full disk at the start: a clear message, not a traceback
            raise disk_error(tmp, e) from e

    def _load_done(self, ds: DatasetRun) -> None:
        """Open the dataset's files (cutting a torn last line) and count what is already on disk."""
        rd = self.rundir
        ds.responses = JsonlAppender(rd.responses(ds.config.name))
        ds.failures = JsonlAppender(rd.failures(ds.config.name))
        for f in (ds.responses, ds.failures):
            if f.cut_bytes:
                self._event("warn", "repaired", f"{f.path}: cut a half-written last line "
                            f"({f.cut_bytes} bytes) left by a crash")
        for _, rec in iter_jsonl(rd.responses(ds.config.name)):
            rid = str(rec.get("id"))
            if rid in ds.done_ids:
                continue
            ds.done_ids.add(rid)
            ds.done += 1
            # A line edited by hand or written by another tool: odd values count as nothing, not a crash.
            usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
            ds.tokens.used += _count(usage.get("completion_tokens"))
            ds.tokens.answers += 1
            cost = _cost(usage.get("cost"))
            ds.cost += cost
            self.money.spent_before += cost
            self.money.answers += 1
            if rec.get("truncated") or rec.get("empty_content"):
                ds.truncated += 1
        for _, rec in iter_jsonl(rd.failures(ds.config.name)):
            rid = str(rec.get("id"))
            if rid not in ds.done_ids:
                ds.done_ids.add(rid)
                ds.failed += 1

    def _scan_prompts(self, ds: DatasetRun) -> None:
        """Count usable prompts and rewrite rejected.jsonl (derived from the input, so rewritten whole)."""
        path = self.rundir.rejected(ds.config.name)
        tmp = path.with_suffix(".jsonl.tmp")
        total = rejected = 0
        try:
            with open(tmp, "wb") as out:
                for item in read_prompts(ds.config.prompts):
                    if isinstance(item, Rejection):
                        rejected += 1
                        out.write(orjson.dumps({"line": item.line, "id": item.id, "reason": item.reason,
                                                "file": str(ds.config.prompts), "ts": time.time()}) + b"\n")
                    else:
                        total += 1
            tmp.replace(path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)  # the old rejected.jsonl stays as it was
            if isinstance(e, OSError):
                raise disk_error(tmp, e) from e
            raise
        ds.total, ds.rejected = total, rejected

    async def _prompts(self, ds: DatasetRun) -> Any:
        """The dataset's prompts not yet on disk, read in a thread a chunk at a time."""
        it: Iterator[Prompt | Rejection] = read_prompts(ds.config.prompts)

        def chunk() -> list[Prompt]:
            out: list[Prompt] = []
            for item in it:
                if isinstance(item, Prompt) and item.id not in ds.done_ids:
                    out.append(item)
                    if len(out) >= PROMPT_CHUNK:
                        break
            return out

        while True:
            batch = await asyncio.to_thread(chunk)
            if not batch:
                return
            for p in batch:
                yield p

    async def _run_dataset(self, ds: DatasetRun) -> None:
        name = ds.config.name
        if self._draining:
            return
        await asyncio.to_thread(self._scan_prompts, ds)
        ds.status = snap.DS_RUNNING
        if ds.rejected:
            self._event("warn", "rejected", f"{name}: {ds.rejected} prompt lines rejected "
                        f"(see {self.rundir.rejected(name)})")
        self._event("info", "dataset_start", f"{name}: {ds.total} prompts, {ds.done} already answered, "
                    f"{ds.failed} already failed; concurrency {ds.config.concurrency}")
        budget_reason = ""
        admitted = 0
        source = self._prompts(ds)
        async for prompt in self._with_requeue(ds, source):
            if budget_reason:
                ds.skipped += 1
                continue
            outcome = await self._admit(ds)
            if outcome == "go":
                self._start_request(ds, prompt)
                admitted += 1
                if admitted % ADMIT_BURST == 0:
                    await asyncio.sleep(0)  # let answers and the UI run between bursts of admissions
            elif outcome == "halt":
                ds.requeue.insert(0, prompt)
                break
            else:
                budget_reason = outcome
                ds.skipped += 1
                ds.status = snap.DS_BUDGET
                ds.message = budget_reason
                self._event("warn", "budget", f"{name}: {budget_reason}; the rest is skipped "
                            "(stays eligible for a later run)")
        while ds.in_flight or ds.requeue:
            if ds.requeue and not self._draining and not ds.stopped and not budget_reason:
                # 402'd prompts waiting for the run to resume.
                async for prompt in self._with_requeue(ds, _empty()):
                    outcome = await self._admit(ds)
                    if outcome != "go":
                        ds.requeue.insert(0, prompt)
                        break
                    self._start_request(ds, prompt)
                continue
            ds.wake.clear()
            if not ds.in_flight:
                break
            await ds.wake.wait()
        if ds.stopped:
            ds.status = snap.DS_STOPPED
        elif budget_reason:
            ds.status = snap.DS_BUDGET
        elif self._stopping or self._draining:
            ds.status = snap.DS_STOPPED
            ds.message = ds.message or "stopped before the end; the next run resumes"
        else:
            ds.status = snap.DS_DONE
        self._event("info", "dataset_done", f"{name}: {ds.status}: {ds.done}/{ds.total} answered, "
                    f"{ds.failed} failed, {ds.skipped} skipped, ${ds.cost:.4f}")

    async def _with_requeue(self, ds: DatasetRun, source: Any) -> Any:
        async for prompt in source:
            while ds.requeue:
                yield ds.requeue.pop(0)
            yield prompt
        while ds.requeue:
            yield ds.requeue.pop(0)

    async def _admit(self, ds: DatasetRun) -> str:
        """"go", "halt" (drain/stop/404), or the reason a budget stops this dataset."""
        while True:
            if self._draining or self._stopping or ds.stopped:
                return "halt"
            if not self._resume.is_set():
                await self._resume.wait()
                continue
            expected = ds.tokens.expected()
            if not ds.tokens.fits(expected):
                # This dataset's answers in flight may come in under their estimate and free room.
                if ds.in_flight:
                    ds.wake.clear()
                    await ds.wake.wait()
                    continue
                return (f"token budget reached: {ds.tokens.used:,} used + {ds.tokens.in_flight:,} in flight "
                        f"of {ds.tokens.limit:,}")
            reason = self.money.blocked(self.money.expected_cost())
            if reason:
                if self.in_flight:
                    ds.wake.clear()
                    await ds.wake.wait()
                    continue
                return reason
            if ds.in_flight >= ds.concurrency.limit:
                ds.wake.clear()
                await ds.wake.wait()
                continue
            return "go"

    def _start_request(self, ds: DatasetRun, prompt: Prompt) -> None:
        expected_tokens = ds.tokens.expected()
        expected_cost = self.money.expected_cost()
        ds.in_flight += 1
        ds.tokens.in_flight += expected_tokens
        self.money.in_flight += expected_cost
        task = asyncio.create_task(self._request(ds, prompt))
        self._tasks.add(task)

        # A done-callback, not a `finally`: a task cancelled before its first step never runs its body.
        def finished(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            ds.in_flight -= 1
            ds.tokens.in_flight -= expected_tokens
            self.money.in_flight -= expected_cost
            if len(self.datasets) == 1:
                ds.wake.set()
            else:
                self._wake_all()
        task.add_done_callback(finished)

    async def _request(self, ds: DatasetRun, prompt: Prompt) -> None:
        assert self._client is not None
        cfg = self.config
        body = cfg.request_body(ds.config, prompt.messages)
        attempt = 0
        outage = 0
        while True:
            attempt += 1
            try:
                answer = await self._client.chat(body)
            except RequestFailed as e:
                self.errors.add(e.kind)
                if e.unreachable and not self._stopping:
                    # Nothing was sent: the network or the server is down. Not this prompt's fault, so no
                    # attempt is spent and it waits the outage out however long it lasts; a drain gives it
                    # up unrecorded (it stays eligible). Spending attempts here failed for good every
                    # prompt in flight or admitted during a few minutes' outage.
                    if self._draining:
                        return
                    attempt -= 1
                    outage += 1
                    self.retries += 1
                    self._note_unreachable(e)
                    await asyncio.sleep(backoff_delay(min(outage, 16), cfg.engine.backoff_base_s,
                                                      cfg.engine.backoff_max_s, None, self._rng))
                    continue
                if e.kind == "429":
                    ds.concurrency.on_429()
                else:
                    ds.concurrency.on_response()
                if e.kind == "402":
                    ds.requeue.append(prompt)
                    self._alert("402 Payment Required: out of credits. The run is paused; add credits "
                                "and press r to resume (headless: kill -USR1 <pid>).")
                    return
                if e.kind == "404_no_endpoints":
                    if not ds.stopped:
                        ds.stopped = True
                        ds.message = f"no endpoints: {self._redact(e.message)[:200]}"
                        self._event("error", "no_endpoints", f"{ds.config.name}: stopped: provider routing "
                                    f"excludes every provider: {self._redact(e.message)}")
                    return
                if e.retryable and attempt < cfg.engine.max_attempts and not self._stopping:
                    self.retries += 1
                    await asyncio.sleep(backoff_delay(attempt, cfg.engine.backoff_base_s,
                                                      cfg.engine.backoff_max_s, e.retry_after, self._rng))
                    await self._retry_slot(ds)
                    continue
                self._record_failure(ds, prompt, e, attempt)
                return
            ds.concurrency.on_response()
            self._record_answer(ds, prompt, answer, attempt)
            return

    async def _retry_slot(self, ds: DatasetRun) -> None:
        """A retry goes out only within the current limit. After sustained 429s cut it, the requests
        over it wait here holding no slot, so what the provider receives drops with the limit; without
        this only new admissions stopped, and every request already in flight kept retrying."""
        if ds.in_flight - ds.parked <= ds.concurrency.limit:
            return
        ds.parked += 1
        try:
            while ds.in_flight - ds.parked >= ds.concurrency.limit:
                ds.wake.clear()
                await ds.wake.wait()  # set when a request ends and when the limit grows
        finally:
            ds.parked -= 1

    def _note_unreachable(self, e: RequestFailed) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = self._clock()
            self._event("warn", "unreachable", f"cannot reach {self.config.api.base_url} "
                        f"({self._redact(e.message)[:200]}): retrying until it answers; no prompt is failed "
                        "while it cannot be reached")

    def _record_answer(self, ds: DatasetRun, prompt: Prompt, a: ChatAnswer, attempts: int) -> None:
        if self._unreachable_since is not None:
            self._event("info", "reachable", f"{self.config.api.base_url} answers again after "
                        f"{self._clock() - self._unreachable_since:.0f} s out of reach")
            self._unreachable_since = None
        truncated = a.finish_reason == "length"
        empty = not a.content.strip()
        record: dict[str, Any] = {
            "id": prompt.id, "messages": prompt.messages, "reasoning": a.reasoning, "content": a.content,
            "tool_calls": a.tool_calls, "finish_reason": a.finish_reason,
            "native_finish_reason": a.native_finish_reason, "provider": a.provider, "model": a.model,
            "generation_id": a.generation_id,
            "usage": {"prompt_tokens": a.usage.prompt_tokens, "completion_tokens": a.usage.completion_tokens,
                      "reasoning_tokens": a.usage.reasoning_tokens, "cost": a.usage.cost},
            "latency_s": round(a.latency_s, 3), "attempts": attempts, "truncated": truncated,
            "empty_content": empty, "ts": round(time.time(), 3)}
        if a.token_ids is not None:
            record["token_ids"] = a.token_ids
        assert ds.responses is not None
        on_disk = self._write(ds.responses, record)
        ds.done += 1
        ds.done_ids.add(prompt.id)
        ds.tokens.used += a.usage.completion_tokens
        ds.tokens.answers += 1
        ds.cost += a.usage.cost
        self.money.spent_run += a.usage.cost
        self.money.answers += 1
        if truncated or empty:
            ds.truncated += 1
            self.errors.add("length" if truncated else "empty_content")
        self.rates.record(a.usage.completion_tokens)
        self.providers.add(a.provider or "unknown")
        if self._on_answer is not None and on_disk:  # a held record is handed on once it is written
            self._on_answer(ds.config.name, record)

    def _record_failure(self, ds: DatasetRun, prompt: Prompt, e: RequestFailed, attempts: int) -> None:
        record = {"id": prompt.id, "messages": prompt.messages, "error_kind": e.kind, "status": e.status,
                  "message": self._redact(e.message), "attempts": attempts, "ts": round(time.time(), 3)}
        assert ds.failures is not None
        self._write(ds.failures, record)
        ds.failed += 1
        ds.done_ids.add(prompt.id)

    def _write(self, appender: JsonlAppender, record: dict[str, Any]) -> bool:
        """True when the record is on disk now; False when it is held in memory (a failed write)."""
        if self._pending_writes:
            self._pending_writes.append((appender, record))
            return False
        try:
            appender.append(record)
        except DiskError as e:
            self._pending_writes.append((appender, record))
            self._alert(f"{e}. The run is paused with {len(self._pending_writes)} record(s) held in memory; "
                        "free space and press r to resume (headless: kill -USR1 <pid>).")
            return False
        return True

    def _flush_pending(self) -> bool:
        while self._pending_writes:
            appender, record = self._pending_writes[0]
            try:
                appender.append(record)
            except DiskError as e:
                self._alert(f"{e}. Still paused: {len(self._pending_writes)} record(s) held in memory.")
                return False
            self._pending_writes.pop(0)
            if self._on_answer is not None:
                for ds in self.datasets.values():
                    if appender is ds.responses:
                        self._on_answer(ds.config.name, record)
        return True

    def _settle_pending(self) -> None:
        """At the end of a run: write what is still held (space may be back); what cannot be written is
        not counted as done (those prompts stay eligible for the next run) and the log says so."""
        if not self._pending_writes or self._flush_pending():
            return
        lost: dict[str, int] = {}
        for appender, record in self._pending_writes:
            for ds in self.datasets.values():
                if appender is ds.responses:
                    ds.done -= 1
                elif appender is ds.failures:
                    ds.failed -= 1
                else:
                    continue
                ds.done_ids.discard(str(record.get("id")))
                lost[str(appender.path)] = lost.get(str(appender.path), 0) + 1
        self._pending_writes.clear()
        where = ", ".join(f"{n} for {path}" for path, n in lost.items())
        self._event("error", "unsaved", f"{sum(lost.values())} record(s) could not be written and are not saved "
                    f"({where}): {self.alert.split('. ')[0]}; the next run asks those prompts again")

    def _alert(self, message: str) -> None:
        first = self.alert != message
        self.alert = message
        if self.state == snap.RUNNING:
            self.state = snap.PAUSED
            self._resume.clear()
        if first:
            self._event("error", "alert", message)

    def _wake_all(self) -> None:
        for d in self.datasets.values():
            d.wake.set()

    def _event(self, level: str, kind: str, message: str) -> None:
        self._on_event(level, kind, self._redact(message))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for ds in self.datasets.values():
                if ds.concurrency.tick():
                    ds.wake.set()

    async def _watch_credits(self) -> None:
        assert self._client is not None
        while True:
            try:
                balance = await self._client.balance()
                if balance is not None:
                    self.money.set_balance(balance)
                    self._wake_all()
            except RequestFailed as e:
                self._event("warn", "credits", f"could not read the balance: {self._redact(e.message)}")
            except Exception as e:  # a balance check must never take the run down
                self._event("warn", "credits", f"could not read the balance: {type(e).__name__}")
            await asyncio.sleep(self.config.api.credits_interval_s)

    # -- the picture ----------------------------------------------------------------------------

    def snapshot(self) -> snap.RunSnapshot:
        self._seq += 1
        win_req, win_tok, win_avg = self.rates.window()
        tot_req, tot_tok, tot_avg = self.rates.total()
        datasets = []
        projected_remaining = 0.0
        admissible = 0
        cost_per_answer = self.money.expected_cost()
        for ds in self.datasets.values():
            remaining = max(0, ds.total - ds.done - ds.failed - ds.skipped)
            if ds.tokens.limit is not None and ds.tokens.answers:
                by_budget = (ds.tokens.remaining() or 0) / max(1.0, ds.tokens.used / ds.tokens.answers)
                remaining = min(remaining, int(by_budget) + ds.in_flight)
            if ds.status in (snap.DS_BUDGET, snap.DS_STOPPED, snap.DS_DONE):
                remaining = ds.in_flight
            projected = ds.cost + remaining * cost_per_answer if cost_per_answer else None
            if projected is not None:
                projected_remaining += projected - ds.cost
            admissible += remaining
            datasets.append(snap.DatasetSnapshot(
                name=ds.config.name, status=snap.DS_PAUSED if (self.state == snap.PAUSED and ds.status ==
                                                              snap.DS_RUNNING) else ds.status,
                total=ds.total, done=ds.done, failed=ds.failed, skipped=ds.skipped, rejected=ds.rejected,
                truncated=ds.truncated, in_flight=ds.in_flight, concurrency=ds.config.concurrency,
                effective_concurrency=ds.concurrency.limit, tokens_used=ds.tokens.used,
                tokens_in_flight=ds.tokens.in_flight, token_budget=ds.tokens.limit, cost_usd=round(ds.cost, 6),
                projected_cost_usd=None if projected is None else round(projected, 4), message=ds.message))
        active = [d for d in self.datasets.values() if d.status == snap.DS_RUNNING] or list(self.datasets.values())
        throughput = snap.Throughput(
            window_s=self.rates.window_s, req_s_window=win_req, req_s_total=tot_req, tok_s_window=win_tok,
            tok_s_total=tot_tok, avg_completion_tokens_window=win_avg, avg_completion_tokens_total=tot_avg,
            history=self.rates.history(), in_flight=self.in_flight,
            effective_concurrency=sum(d.concurrency.limit for d in active),
            configured_concurrency=sum(d.config.concurrency for d in active),
            eta_s=(admissible / win_req) if win_req > 0 and self.state == snap.RUNNING else None)
        credits = snap.Credits(
            balance_usd=self.money.balance_now(), balance_age_s=self.money.balance_age(),
            spent_usd=self.money.spent_run, spent_total_usd=self.money.spent_total,
            in_flight_usd=self.money.in_flight,
            projected_total_usd=(self.money.spent_total + projected_remaining) if cost_per_answer else None,
            max_usd=self.money.max_usd, floor_usd=self.money.floor_usd)
        return snap.RunSnapshot(
            run_name=self.rundir.root.name, model=self.config.api.model, state=self.state,
            elapsed_s=self._clock() - self._started, seq=self._seq, datasets=tuple(datasets),
            throughput=throughput, errors=self.errors.items(), retries=self.retries,
            providers=self.providers.items(), credits=credits, alert=self.alert)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def _cost(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and 0 <= value < 1e9 else 0.0


async def _empty() -> Any:
    return
    yield  # pragma: no cover - makes this an async generator
