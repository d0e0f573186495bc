"""Reconstruction during a run: answers are tokenized as the engine lands them.

`LiveReconstructor.submit` never blocks: answers are batched (briefly) and handed to the worker
pool (core/tokens/workers.py); results are appended to the dataset's token folder from the event
loop thread as they come back. A batch lost to a dead worker is not retried here: those answers
stay in responses.jsonl and the next `catch_up` or `draftgen tokens` picks them up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.live.snapshot import ProviderFidelity, StageProgress, StageState
from draftgen.core.merge.policy import SamplePolicy
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.report import ValidationReport
from draftgen.core.tokens.store import TokenWriter
from draftgen.core.tokens.workers import (
    BATCH_ANSWERS, BATCH_CHARS, LockedWriter, Result, TokenRate, WorkerSpec, check_dataset, cores, index_report,
    new_pool, pending_offsets, ping, provider_flags, read_records, reconstruct_batch, record_chars, slim_record,
    write_report)


@dataclass
class _Dataset:
    """One dataset's side of a live reconstruction: its token folder and what is on its way there."""
    name: str
    folder: Path
    writer: TokenWriter
    report: ValidationReport
    known: set[str]                    # ids committed or on their way
    buffer: list[dict[str, Any]] = field(default_factory=list)
    buffer_chars: int = 0

    @classmethod
    def open(cls, run: RunDir, name: str, policy: SamplePolicy) -> _Dataset:
        folder = run.tokens(name)
        writer = LockedWriter(folder)
        return cls(name, folder, writer, index_report(folder, name, policy), set(writer.ids))

    def take(self) -> list[dict[str, Any]]:
        batch, self.buffer, self.buffer_chars = self.buffer, [], 0
        return batch


class LiveReconstructor:
    """Reconstructs answers as the engine lands them, in worker processes."""

    FLUSH_AFTER_S = 0.05

    def __init__(self, config: Config, workers: int = 0) -> None:
        self.config = config
        # Leave a core to the event loop unless told otherwise.
        self.workers = workers or max(1, cores() - 1)
        self._spec = WorkerSpec.from_config(config)
        self._run = RunDir(config.run_dir)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._datasets: dict[str, _Dataset] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rate = TokenRate()
        self._submitted = 0
        self._lost = 0
        self._error = ""
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._start_blocking)

    def _start_blocking(self) -> None:
        self._spec.load()  # a missing or broken tokenizer is a clear error here
        for ds in self.config.datasets:
            self._open(ds.name)
        pool = new_pool(self._spec, self.workers)
        # Start every worker (and load its tokenizer) now, off the event loop.
        for fut in [pool.submit(ping) for _ in range(self.workers)]:
            fut.result()
        self._pool = pool

    def _open(self, name: str) -> _Dataset:
        ds = self._datasets.get(name)
        if ds is None:
            ds = self._datasets[name] = _Dataset.open(self._run, name, SamplePolicy.from_config(self.config))
        return ds

    # -- intake ---------------------------------------------------------------------------------

    def submit(self, dataset_name: str, record: dict[str, Any]) -> None:
        """Queue one answered record for reconstruction; returns at once."""
        if self._pool is None or self._loop is None or self._closed:
            raise RuntimeError("LiveReconstructor.submit before start() or after close()")
        ds = self._open(dataset_name)
        rid = str(record.get("id"))
        if rid in ds.known:
            return
        ds.known.add(rid)
        self._submitted += 1
        slim = slim_record(record)
        ds.buffer.append(slim)
        ds.buffer_chars += record_chars(slim)
        if len(ds.buffer) >= BATCH_ANSWERS or ds.buffer_chars >= BATCH_CHARS:
            self._flush(ds)
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_later(self.FLUSH_AFTER_S, self._flush_all)

    def _flush_all(self) -> None:
        self._flush_handle = None
        for ds in list(self._datasets.values()):
            self._flush(ds)

    def _flush(self, ds: _Dataset) -> None:
        if not ds.buffer:
            return
        batch = ds.take()
        assert self._loop is not None and self._pool is not None
        try:
            fut = self._loop.run_in_executor(self._pool, reconstruct_batch, batch)
        except RuntimeError as e:  # the pool broke earlier (BrokenProcessPool is a RuntimeError)
            self._lose(ds, batch, e)
            return
        self._inflight.add(fut)
        fut.add_done_callback(partial(self._landed, ds, batch))

    def _lose(self, ds: _Dataset, batch: list[dict[str, Any]], exc: BaseException) -> None:
        self._error = f"token reconstruction stopped: {exc}"
        self._lost += len(batch)
        for rec in batch:
            ds.known.discard(str(rec.get("id")))

    def _landed(self, ds: _Dataset, batch: list[dict[str, Any]], fut: asyncio.Future[list[Result]]) -> None:
        self._inflight.discard(fut)
        if fut.cancelled():
            self._lose(ds, batch, RuntimeError("cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._lose(ds, batch, exc)
            return
        for rid, ids, mask, meta in fut.result():
            try:
                ds.writer.append(rid, ids, mask, meta)
            except Exception as e:  # a full disk: stop counting it as done, say so
                self._lose(ds, [{"id": rid}], e)
                continue
            ds.report.add_meta(meta)
            self._rate.add(int(ids.shape[0]))

    # -- catching up with what is on disk -----------------------------------------------------------

    async def catch_up(self, dataset_name: str) -> int:
        """Queue every answer of `dataset_name` already on disk but not yet in its tokens folder
        (e.g. after a crash); returns how many. The work continues in the background; `wait_idle`
        or `close` waits for it."""
        check_dataset(self.config, dataset_name)
        ds = self._open(dataset_name)
        responses = self._run.responses(dataset_name)
        offsets = await asyncio.to_thread(pending_offsets, responses, set(ds.known))
        if offsets:
            task = asyncio.create_task(self._feed(dataset_name, responses, offsets))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(offsets)

    async def _feed(self, name: str, responses: Path, offsets: list[int]) -> None:
        chunk = BATCH_ANSWERS * self.workers
        try:
            for i in range(0, len(offsets), chunk):
                part = offsets[i:i + chunk]
                records = await asyncio.to_thread(lambda: list(read_records(responses, part)))
                for rec in records:
                    if self._closed:
                        return
                    self.submit(name, rec)
                self._flush_all()
                # Bounded memory: keep about two batches per worker queued.
                while len(self._inflight) > 2 * self.workers:
                    await asyncio.wait(set(self._inflight), return_when=asyncio.FIRST_COMPLETED)
        except (OSError, ValueError) as e:  # responses.jsonl unreadable: say so, the run goes on
            self._error = f"token reconstruction could not read {responses}: {e}"

    async def wait_idle(self) -> None:
        """Wait until everything submitted or queued by `catch_up` is written."""
        while self._tasks or self._inflight or any(ds.buffer for ds in self._datasets.values()):
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._flush_all()
            if self._inflight:
                await asyncio.wait(set(self._inflight))

    # -- views ----------------------------------------------------------------------------------------

    def report(self, dataset_name: str | None = None) -> ValidationReport:
        """One dataset's report (every answer in its tokens folder), or all datasets' with None."""
        if dataset_name is None:
            return ValidationReport.combine(ds.report for ds in self._datasets.values())
        if dataset_name not in self._datasets:
            return ValidationReport(dataset_name, policy=SamplePolicy.from_config(self.config))
        return self._datasets[dataset_name].report

    def fidelity(self) -> tuple[ProviderFidelity, ...]:
        """Each provider's token-count agreement over every dataset so far, flagged where it departs."""
        total = self.report(None)
        flags = {f.provider: f.reason for f in provider_flags(self.config, total)}
        rows = []
        for name, a in sorted(total.providers.items(), key=lambda kv: -kv[1].answers):
            if a.answers:
                rows.append(ProviderFidelity(name, a.answers, a.answer.share_exact, a.prompt.share_exact,
                                             flags.get(name, "")))
        return tuple(rows)

    def progress(self) -> StageProgress:
        done = self._rate.answers
        per_s, tok_s = self._rate.per_s()
        waiting = self._submitted - done - self._lost
        state = StageState.FAILED if self._error else (StageState.DONE if self._closed else StageState.RUNNING)
        total = self.report(None)
        return StageProgress(
            name="tokens", state=state, done=done, total=self._submitted, rate=per_s if done else 0.0,
            rate_unit="answers/s",
            detail=(("valid", f"{total.valid:,}/{total.checked:,}"), ("waiting", f"{waiting:,}"),
                    ("tokens/s", f"{tok_s:,.0f}" if done else "0")),
            message=self._error or total.summary_line())

    # -- shutdown -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish everything queued, write each dataset's report.json, stop the workers."""
        if self._closed:
            return
        if self._pool is not None:
            await self.wait_idle()
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pool, self._pool = self._pool, None

        def finish() -> None:
            for ds in self._datasets.values():
                ds.writer.close()
                write_report(ds.folder, ds.report, provider_flags(self.config, ds.report))
            if pool is not None:
                pool.shutdown(wait=True)
        await asyncio.to_thread(finish)
