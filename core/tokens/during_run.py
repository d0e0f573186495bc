"""Reconstruction during a run: answers are tokenized as the engine lands them.

`RunReconstructor.submit` never blocks: answers are batched (briefly) and handed to the worker
pool (core/tokens/workers.py); results are appended to the dataset's token folder from the event
loop thread as they come back.

A worker that dies (kill -9, the OOM killer) breaks the whole pool: every batch in flight fails at
once. They are held, a new pool is started and they are sent again (core/tokens/respawn.py). After
`MAX_RESTARTS` new pools reconstruction stops for the rest of the run and says so (`progress()`
FAILED, with the command that finishes it, `draftgen tokens CONFIG`): the answers stay in
responses.jsonl.

Memory stays bounded when the workers fall behind the engine: an answer submitted while `LIVE_BACKLOG`
batches per worker are already queued is not kept (its line is on disk); its dataset is marked
behind, and once the queue has drained to a batch per worker the answers not yet queued are read back
from responses.jsonl (from where the last such read began, not the whole file) and fed at the
workers' pace (`_feed`). Without it a run whose reconstruction lagged kept every answer waiting for a
worker in memory (~0.5 KB an answer of the simulator's, more for long answers), without levelling off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import DiskError
from draftgen.core.live.events import EventSink, no_event
from draftgen.core.live.snapshot import ProviderFidelity, StageProgress, StageState, TurnAgreement
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import RunDir, jsonl_objects
from draftgen.core.tokens.fidelity import turn_figures
from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import Answer, answer_fields
from draftgen.core.tokens.report import ValidationReport
from draftgen.core.tokens.respawn import RespawningPool
from draftgen.core.tokens.store import TokenWriter
from draftgen.core.tokens.workers import (
    BATCH_ANSWERS,
    BATCH_CHARS,
    LockedWriter,
    Results,
    TokenRate,
    check_dataset,
    cores,
    each_sample,
    index_report,
    pending_offsets,
    provider_flags,
    read_records,
    record_chars,
    worker_spec,
    write_report,
)


@dataclass
class _Dataset:
    """One dataset's side of a live reconstruction: its token folder and what is on its way there."""
    name: str
    folder: Path
    writer: TokenWriter
    report: ValidationReport
    # Ids committed or on their way: the writer's own set of committed ids (`writer.ids`), not a copy of it,
    # so each answered id is kept once (its string and its table entry), not twice; the writer adds what it
    # commits, already there. Nothing reads `writer.ids` during a run beyond this.
    known: set[str]
    lost: set[str] = field(default_factory=set)  # ids whose token ids could not be made or written this run
    buffer: list[Answer] = field(default_factory=list)
    buffer_chars: int = 0
    behind: int = 0     # answers submitted and not kept (the queue was full): read back from disk later
    scan_from: int = 0  # responses.jsonl offset before which every answer was queued, written or read back

    @classmethod
    def open(cls, run: RunDir, name: str, policy: SamplePolicy) -> _Dataset:
        folder = run.tokens(name)
        writer = LockedWriter(folder)
        return cls(name, folder, writer, index_report(folder, name, policy), writer.ids,
                   scan_from=_size(run.responses(name)))

    def take(self) -> list[Answer]:
        batch, self.buffer, self.buffer_chars = self.buffer, [], 0
        return batch


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _offsets_from(responses: Path, start: int, done: set[str]) -> list[int]:
    """`pending_offsets` from byte `start` on (a line boundary: the file's size at some earlier time)."""
    if not responses.exists():
        return []
    offsets = []
    with open(responses, "rb") as f:
        f.seek(start)
        for offset, rec in jsonl_objects(f):
            if (rid := str(rec.get("id"))) not in done:
                done.add(rid)
                offsets.append(start + offset)
    return offsets


def _read_list(responses: Path, offsets: list[int]) -> list[Answer]:
    """The records at `offsets`, read in one go (in a worker thread)."""
    return list(read_records(responses, offsets))


class RunReconstructor:
    """Reconstructs answers as the engine lands them, in worker processes."""

    # A batch goes to a worker once it holds BATCH_ANSWERS answers (or BATCH_CHARS of text), or FLUSH_AFTER_S
    # after its first answer. Short answers arrive by the thousand a second: every batch costs both processes
    # a pickle, a pipe round trip and a wake-up, so fewer, larger batches cost less CPU an answer (and the
    # answers wait a little longer for their ids, which nothing waits on until the run's end). 1,024 rather
    # than 256: the worker woken a quarter as often cost ~5 us an answer less in bench_engine's runs of ~100-token
    # answers (BENCHMARKS.md, Token reconstruction during a run); long answers reach BATCH_CHARS first. Batches
    # by time (2 s, up to 4,096 answers) were tried and measured no better (the same page), the live row 2 s late.
    FLUSH_AFTER_S = 0.5
    BATCH_ANSWERS = 1024
    LIVE_BACKLOG = 4  # batches per worker queued before a submitted answer is left on disk for later
    MAX_RESTARTS = 3   # new pools after dead workers before reconstruction gives up for the run

    def __init__(self, config: Config, workers: int = 0,
                 on_event: EventSink | None = None, rundir: RunDir | None = None) -> None:
        self.config = config
        self._event = on_event or no_event
        # Leave a core to the event loop unless told otherwise.
        self.workers = workers or max(1, cores() - 1)
        self._spec = worker_spec(config)
        self._run = rundir or RunDir(config.run_dir)  # the pipeline's (one per run), or its own
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: RespawningPool[_Dataset] = RespawningPool(
            self._spec, self.workers, hint=f"finish with `draftgen tokens {sh_path(config.path)}`",
            max_restarts=lambda: self.MAX_RESTARTS, on_landed=self._landed, on_lost=self._lose,
            on_give_up=self._gave_up, on_event=self._event)
        self._datasets: dict[str, _Dataset] = {}
        self._total: ValidationReport | None = None  # every dataset's report combined, until the next lands
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rate = TokenRate()
        self._submitted = 0
        self._lost = 0
        self._error = ""
        # A full disk: each file it refused, once, in order (the stage stops, `draftgen tokens` finishes).
        self._unwritten: list[str] = []
        self._closed = False

    @property
    def restarts(self) -> int:
        """New pools started after dead workers so far."""
        return self._pool.restarts

    @property
    def _restart(self) -> asyncio.Task[None] | None:  # a new pool starting (tests wait for it)
        return self._pool.restart

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._start_blocking)
        await self._pool.open()  # returns before its workers are ready: what is submitted meanwhile waits

    def _start_blocking(self) -> None:
        self._spec.load()  # a missing or broken tokenizer is a clear error here, before any request is sent
        for ds in self.config.datasets:
            self._open(ds.name)

    def _open(self, name: str) -> _Dataset:
        ds = self._datasets.get(name)
        if ds is None:
            ds = self._datasets[name] = _Dataset.open(self._run, name, SamplePolicy.from_config(self.config))
            self._total = None
        return ds

    # -- intake ---------------------------------------------------------------------------------

    def submit(self, dataset_name: str, record: Mapping[str, Any], *, live: bool = True) -> None:
        """Queue one answered record for reconstruction; returns at once. `live`: the engine's answer,
        left on disk for later when the workers are behind (one read back from disk is always queued)."""
        ds = self._intake(dataset_name, str(record.get("id")), live)
        if ds is not None:
            self._queue(ds, answer_fields(record))

    def _intake(self, dataset_name: str, rid: str, live: bool) -> _Dataset | None:
        """The dataset answer `rid` is queued in, counted as on its way; None when it is not queued now
        (already on its way or written, or left on disk while the workers are behind)."""
        if self._loop is None or self._closed:
            raise RuntimeError("RunReconstructor.submit before start() or after close()")
        ds = self._open(dataset_name)
        if rid in ds.known:
            return None
        if live and self._pool.backlog >= self.LIVE_BACKLOG * self.workers:
            ds.behind += 1  # its line is on disk: read back once the workers have caught up (_landed)
            return None
        ds.known.add(rid)
        self._submitted += 1
        return ds

    def _queue(self, ds: _Dataset, answer: Answer) -> None:
        assert self._loop is not None  # _intake said so
        ds.buffer.append(answer)
        ds.buffer_chars += record_chars(answer)
        if len(ds.buffer) >= self.BATCH_ANSWERS or ds.buffer_chars >= BATCH_CHARS:
            self._flush(ds)
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_later(self.FLUSH_AFTER_S, self._flush_all)

    def _flush_all(self) -> None:
        self._flush_handle = None
        for ds in list(self._datasets.values()):
            self._flush(ds)

    def _flush(self, ds: _Dataset) -> None:
        if ds.buffer:
            self._pool.send(ds, ds.take())

    # -- what comes back from the workers -------------------------------------------------------

    def _landed(self, ds: _Dataset, batch: list[Answer], results: Results) -> None:
        ids, masks, samples, report = results
        try:
            ds.writer.append_encoded(ids, masks, samples)  # the whole batch in one write per file
        except Exception:  # a full disk: nothing of the batch was kept; answer by answer, as far as it goes
            self._land_each(ds, results)
        else:
            ds.report.merge(report)  # counted by the worker: one merge a batch, nothing an answer
            self._rate.add(len(masks), len(samples))
        self._total = None
        if ds.behind and self._pool.backlog <= self.workers and not self._closed:
            self._read_back(ds)

    def _land_each(self, ds: _Dataset, results: Results) -> None:
        for rid, ids, mask, meta in each_sample(results):
            try:
                ds.writer.append(rid, ids, mask, meta)
            except Exception as e:  # a full disk: stop counting it as done, say so
                self._lose(ds, [(rid,)], e)  # the answer's id: all _lose reads of it
                continue
            ds.report.add_meta(meta)
            self._rate.add(int(ids.shape[0]))

    def _read_back(self, ds: _Dataset) -> None:
        """Feed the answers of `ds` that were left on disk while the workers were behind: those from
        its scan point on with no token ids queued or written."""
        ds.behind = 0
        start, ds.scan_from = ds.scan_from, _size(self._run.responses(ds.name))
        task = asyncio.create_task(self._read_back_from(ds, start))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_back_from(self, ds: _Dataset, start: int) -> None:
        responses = self._run.responses(ds.name)
        try:
            offsets = await asyncio.to_thread(_offsets_from, responses, start, ds.known | ds.lost)
        except OSError as e:
            self._error = f"token reconstruction could not read {responses}: {e}"
            return
        if offsets:
            await self._feed(ds.name, responses, offsets)

    def _lose(self, ds: _Dataset, batch: list[Answer], exc: BaseException) -> None:
        if isinstance(exc, DiskError):  # no room: nothing is wrong with the answers, the stage stops
            self._refused(exc)
        elif not self._error:
            self._error = f"token reconstruction stopped: {exc}"
        self._lost += len(batch)
        for rec in batch:
            rid = str(rec[0])
            ds.known.discard(rid)
            ds.lost.add(rid)  # not sent again this run (a final catch-up would count it twice)

    def _refused(self, exc: DiskError) -> None:
        """Said in `progress()`: every file refused, not only the first (token ids refused while the
        run stops do not hide the report.json refused after them)."""
        if str(exc) not in self._unwritten:
            self._unwritten.append(str(exc))

    def _gave_up(self, message: str) -> None:
        self._error = message  # the workers kept dying: this says why and how to finish, over any earlier error

    # -- catching up with what is on disk -----------------------------------------------------------

    async def catch_up(self, dataset_name: str) -> int:
        """Queue every answer of `dataset_name` already on disk but not yet in its tokens folder
        (e.g. after a crash); returns how many. The work continues in the background; `wait_idle`
        or `close` waits for it."""
        check_dataset(self.config, dataset_name)
        ds = self._open(dataset_name)
        responses = self._run.responses(dataset_name)
        offsets = await asyncio.to_thread(pending_offsets, responses, ds.known | ds.lost)
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
                records = await asyncio.to_thread(_read_list, responses, part)
                for answer in records:
                    if self._closed:
                        return
                    if (ds := self._intake(name, str(answer[0]), False)) is not None:
                        self._queue(ds, answer)
                self._flush_all()
                # Bounded memory: keep about two batches per worker queued (or held for a new pool).
                while self._pool.backlog > 2 * self.workers:
                    if not await self._pool.wait_one():
                        break
        except (OSError, ValueError) as e:  # responses.jsonl unreadable: say so, the run goes on
            self._error = f"token reconstruction could not read {responses}: {e}"

    async def wait_idle(self) -> None:
        """Wait until everything submitted or queued by `catch_up` is written (or lost, and said so)."""
        while (self._tasks or self._pool.busy or any(ds.buffer for ds in self._datasets.values())
               or any(ds.behind for ds in self._datasets.values())):
            for ds in self._datasets.values():
                if ds.behind and not self._pool.busy:
                    self._read_back(ds)
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._flush_all()
            if not await self._pool.wait_one():  # nothing in flight, no new pool starting: send what is held
                self._pool.release_held()

    # -- views ----------------------------------------------------------------------------------------

    def report(self, dataset_name: str | None = None) -> ValidationReport:
        """One dataset's report (every answer in its tokens folder), or all datasets' with None (combined
        again only once another batch has landed: the stage's row and fidelity figures ask 4 times a second)."""
        if dataset_name is None:
            if self._total is None:
                self._total = ValidationReport.combine(ds.report for ds in self._datasets.values())
            return self._total
        if dataset_name not in self._datasets:
            return ValidationReport(dataset_name, policy=SamplePolicy.from_config(self.config))
        return self._datasets[dataset_name].report

    def fidelity(self) -> tuple[ProviderFidelity, ...]:
        """Each provider's token-count agreement over every dataset so far, flagged where it departs."""
        total = self.report(None)
        flags = {f.provider: f.reason + (f"; to change: {f.fix}" if f.absolute else "")
                 for f in provider_flags(self.config, total)}
        rows = []
        for name, a in sorted(total.providers.items(), key=lambda kv: -kv[1].answers):
            if a.answers:
                turns = tuple(TurnAgreement(t.turn, t.n, t.share_exact, t.mean_diff)
                              for t in turn_figures(a.prompt_turns))
                rows.append(ProviderFidelity(name, a.answers, a.answer.share_exact, a.prompt.share_exact,
                                             flags.get(name, ""), turns))
        return tuple(rows)

    def progress(self) -> StageProgress:
        """`done` of `total`: the answers with token ids, of every answer known (earlier runs' included).
        FAILED when reconstruction broke; STOPPED when the disk refused what it wrote (its message says
        what could not be written, and `draftgen tokens` finishes it)."""
        landed = self._rate.answers
        per_s, tok_s = self._rate.per_s()
        waiting = self._submitted - landed - self._lost + sum(ds.behind for ds in self._datasets.values())
        state = (StageState.FAILED if self._error else StageState.STOPPED if self._unwritten
                 else StageState.DONE if self._closed else StageState.RUNNING)
        total = self.report(None)
        detail: tuple[tuple[str, str], ...] = (
            ("valid", f"{total.valid:,}/{total.checked:,}"), ("waiting", f"{waiting:,}"),
            ("tokens/s", f"{tok_s:,.0f}" if landed else "0"))
        if self.restarts:
            detail += (("worker restarts", str(self.restarts)),)
        return StageProgress(
            name="tokens", state=state, done=total.checked, total=total.checked + waiting + self._lost,
            rate=per_s if landed else 0.0, rate_unit="answers/s", detail=detail,
            message=self._error or (f"{'; '.join(self._unwritten)}; finish with "
                                    f"`draftgen tokens {sh_path(self.config.path)}`"
                                    if self._unwritten else total.summary_line()))

    # -- shutdown -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish everything queued, write each dataset's report.json, stop the workers. A file the disk
        refuses is said in `progress()` (the stage stops), never raised: the run's end goes on."""
        if self._closed:
            return
        if self._loop is not None:
            await self.wait_idle()
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pool = self._pool.detach()

        def finish() -> None:
            for ds in self._datasets.values():
                try:
                    ds.writer.close()
                    write_report(ds.folder, ds.report, provider_flags(self.config, ds.report))
                except DiskError as e:
                    self._refused(e)
            if pool is not None:
                pool.shutdown(wait=True)
        await asyncio.to_thread(finish)
