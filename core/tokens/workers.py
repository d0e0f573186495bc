"""Reconstruction of whole datasets: what is on disk (`draftgen tokens`) and what lands during a run.

Both read `<run>/<dataset>/responses.jsonl`, skip every id already committed to
`<dataset>/tokens/index.jsonl`, and append the rest with `TokenWriter` (core/tokens/store.py; index
metadata as documented in core/records.py), so they are incremental and resumable: a crash leaves at
most a torn index line, which the writer cuts off on reopening. `<dataset>/tokens/report.json` holds
the `ValidationReport` of every answer in the folder.

Tokenization runs in worker processes (each loads the tokenizer once, in its initializer) on
batches of answers, so all cores work and the event loop of a live run never waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.tokens.reconstruct import CHECKS, DEFAULT_COUNT_TOLERANCE, ValidationReport, reconstruct_record, unrenderable
from draftgen.core.rundir import RunDir, disk_error, iter_jsonl, read_line_at
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.tokens.template import ChatTemplate, load_template
from draftgen.core.tokens.tokenizer import Tokenizer, load_tokenizer
from draftgen.core.tokens.store import INDEX_FILE, TokenWriter

REPORT_FILE = "report.json"
LOCK_FILE = "writer.lock"     # flock'ed by the one process writing the folder
BATCH_ANSWERS = 32            # answers per worker task: amortises IPC without starving cores
BATCH_CHARS = 1 << 20         # ... or fewer when they are long
INLINE_MAX = 32               # fewer pending answers than this: not worth starting processes
PROGRESS_EVERY_S = 0.25
# The fields of a response line that reconstruction reads (the rest never crosses to a worker).
_FIELDS = ("id", "messages", "reasoning", "content", "tool_calls", "finish_reason", "truncated", "token_ids")

Progress = Callable[[StageProgress], None]
Result = tuple[str, np.ndarray, np.ndarray, dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# Worker side


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker process builds its tokenizer and template (picklable)."""
    tokenizer_path: str
    trust_remote_code: bool
    template: str
    count_tolerance: int = DEFAULT_COUNT_TOLERANCE

    @classmethod
    def from_config(cls, config: Config) -> "WorkerSpec":
        t = config.tokenizer
        return cls(t.path, t.trust_remote_code, t.template)

    def load(self) -> tuple[Tokenizer, ChatTemplate]:
        tok = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        return tok, load_template(self.template, tok)


_worker: tuple[Tokenizer, ChatTemplate, int] | None = None


def _init_worker(spec: WorkerSpec) -> None:
    global _worker
    tok, template = spec.load()
    _worker = (tok, template, spec.count_tolerance)


def _init_pool_worker(spec: WorkerSpec) -> None:
    """A pool worker's initializer: tied to the process that made the pool, deaf to the terminal.

    Ctrl-C, a closed tmux pane and `kill -TERM -PGID` signal the whole process group: the main
    process drains and then stops its workers itself, so a worker must not die first (its batch
    would be lost and the pool broken). And when the main process dies (kill -9, the OOM killer) a
    worker blocked on the pool's queue would wait forever, keeping the forkserver and the resource
    tracker alive with it, each holding a tokenizer: it exits as soon as its parent is gone."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)

        def exit_with_parent() -> None:
            parent.join()  # returns when the parent's end of the pipe closes: it has exited
            os._exit(0)
        threading.Thread(target=exit_with_parent, name="draftgen-parent-watch", daemon=True).start()
    _init_worker(spec)


def _ping(_: object = None) -> bool:
    return _worker is not None


def reconstruct_batch(records: list[dict[str, Any]]) -> list[Result]:
    """(id, input_ids, loss_mask, index metadata) of each record, in order (runs in a worker)."""
    assert _worker is not None, "reconstruct_batch runs in a worker started with _init_worker"
    tok, template, tolerance = _worker
    out: list[Result] = []
    for rec in records:
        try:
            r = reconstruct_record(tok, template, rec, count_tolerance=tolerance)
        except Exception as e:  # one odd answer must not sink its batch: it is flagged, the rest go on
            r = unrenderable(f"{type(e).__name__}: {e}")
        out.append((str(rec.get("id")), r.input_ids, r.loss_mask, r.index_meta()))
    return out


def _slim(record: dict[str, Any]) -> dict[str, Any]:
    slim = {k: record[k] for k in _FIELDS if k in record}
    usage = record.get("usage")
    if isinstance(usage, dict):
        slim["usage"] = {"completion_tokens": usage.get("completion_tokens")}
    return slim


def _record_chars(rec: dict[str, Any]) -> int:
    n = sum(len(v) for v in (rec.get("reasoning"), rec.get("content")) if isinstance(v, str))
    messages = rec.get("messages")
    for m in messages if isinstance(messages, list) else ():
        c = m.get("content") if isinstance(m, dict) else None
        n += len(c) if isinstance(c, str) else 64
    return n


def _batches(records: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    chars = 0
    for rec in records:
        batch.append(rec)
        chars += _record_chars(rec)
        if len(batch) >= BATCH_ANSWERS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker against the real stderr. Inside the TUI, sys.stderr is
    Textual's print capture, whose fileno() is -1: the tracker would pass that fd to its child and
    fail to start (ValueError: bad value(s) in fds_to_keep), taking live reconstruction down with it."""
    from multiprocessing import resource_tracker
    try:
        usable = sys.stderr.fileno() >= 0
    except (AttributeError, ValueError, OSError):
        usable = True  # the tracker skips a stderr without a fileno() by itself
    if usable or sys.__stderr__ is None:
        resource_tracker.ensure_running()
        return
    captured, sys.stderr = sys.stderr, sys.__stderr__
    try:
        resource_tracker.ensure_running()
    finally:
        sys.stderr = captured


_TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _start_helpers() -> None:
    """Start the resource tracker and the forkserver with the terminal's signals blocked: a blocked
    mask survives exec, so a Ctrl-C, a closed tmux pane or `kill -TERM -PGID` (which signal the whole
    process group) cannot kill them. A dead forkserver looks to the pool like every worker died at
    once: the pool breaks and live reconstruction stops while the run is draining."""
    import multiprocessing.forkserver
    for start in (_start_resource_tracker, multiprocessing.forkserver.ensure_running):
        # Each under its own block: the tracker's own start unblocks SIGINT and SIGTERM when done.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINAL_SIGNALS)
        try:
            start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _new_pool(spec: WorkerSpec, workers: int) -> concurrent.futures.ProcessPoolExecutor:
    # forkserver, not fork: the live run forks from a process with an event loop and threads.
    ctx = multiprocessing.get_context("forkserver")
    _start_helpers()
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_pool_worker,
                                               initargs=(spec,))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Shared bookkeeping


class TokensBusy(DraftgenError):
    """Another process is writing the tokens folder."""


class _LockedWriter(TokenWriter):
    """A TokenWriter that holds an exclusive lock on its folder while open. Two writers would each
    append at the offsets they believe in (and the second one's opening repair truncates what the
    first is writing): `draftgen tokens` during a live `run` silently corrupted the token files.
    The lock goes with the process, so a crash never leaves it held."""

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        path = folder / LOCK_FILE
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise disk_error(path, e) from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            super().__init__(folder)  # only now: opening repairs (truncates) the files
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TokensBusy(f"{folder}: another draftgen process is writing these token files (a live `draftgen "
                             "run` reconstructs its answers as they land); a second writer would corrupt them. "
                             "Wait until it has finished and run this again.") from None
        except BaseException:
            os.close(self._lock_fd)
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _dataset_names(config: Config) -> list[str]:
    return [d.name for d in config.datasets]


def _check_dataset(config: Config, name: str) -> None:
    if name not in _dataset_names(config):
        raise ConfigError(f"{config.path}: no dataset named {name!r} (datasets: {', '.join(_dataset_names(config))})")


def index_report(folder: Path, name: str) -> ValidationReport:
    """The report of every sample committed in a tokens folder (read from its index metadata)."""
    report = ValidationReport(name)
    for _, entry in iter_jsonl(Path(folder) / INDEX_FILE):
        report.add_meta(entry)
    return report


def write_report(folder: Path, report: ValidationReport) -> Path:
    """`<tokens>/report.json`, replaced atomically."""
    path = Path(folder) / REPORT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)
    return path


class _Rate:
    """Answers and tokens per second since the first one, for progress lines."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.answers = 0
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.answers += 1
        self.tokens += tokens

    def per_s(self) -> tuple[float, float]:
        dt = max(1e-6, time.monotonic() - self.t0)
        return self.answers / dt, self.tokens / dt


# ---------------------------------------------------------------------------------------------
# `draftgen tokens`: one dataset, on disk


def _pending(responses: Path, done: set[str]) -> list[int]:
    """Offsets of the response lines whose id has no tokens yet (first occurrence of an id only)."""
    offsets, seen = [], set(done)
    for offset, rec in iter_jsonl(responses):
        rid = str(rec.get("id"))
        if rid not in seen:
            seen.add(rid)
            offsets.append(offset)
    return offsets


def _read_records(responses: Path, offsets: Iterable[int]) -> Iterator[dict[str, Any]]:
    with open(responses, "rb") as f:
        for offset in offsets:
            yield _slim(read_line_at(f, offset))


def reconstruct_dataset(config: Config, dataset_name: str, progress: Progress | None = None, *,
                        workers: int | None = None,
                        pool: concurrent.futures.ProcessPoolExecutor | None = None) -> ValidationReport:
    """Reconstruct every answer of `dataset_name` not yet in its tokens folder; the folder's full report.

    `workers`: processes to use (default: config.engine.workers, 0 meaning one per core). `pool`: a
    pool made by `worker_pool` to share between datasets (else one is started when worth it).
    """
    _check_dataset(config, dataset_name)
    run = RunDir(config.run_dir)
    responses, folder = run.responses(dataset_name), run.tokens(dataset_name)
    spec = WorkerSpec.from_config(config)
    n_workers = workers if workers is not None else (config.engine.workers or _cores())
    with _LockedWriter(folder) as writer:
        report = index_report(folder, dataset_name)
        offsets = _pending(responses, writer.ids)
        total = len(offsets)
        rate = _Rate()
        last = [0.0]

        def tell(state: str = "running", force: bool = False) -> None:
            now = time.monotonic()
            if progress is None or (not force and now - last[0] < PROGRESS_EVERY_S):
                return
            last[0] = now
            per_s, tok_s = rate.per_s()
            left = total - rate.answers
            progress(StageProgress(
                name="tokens", state=state, done=rate.answers, total=total, rate=per_s, rate_unit="answers/s",
                eta_s=left / per_s if per_s > 0 and left else None,
                detail=(("dataset", dataset_name), ("valid", f"{report.valid:,}/{report.checked:,}"),
                        ("tokens/s", f"{tok_s:,.0f}")),
                message=f"{dataset_name}: {rate.answers:,}/{total:,} answers reconstructed"))

        def land(results: list[Result]) -> None:
            for rid, ids, mask, meta in results:
                writer.append(rid, ids, mask, meta)
                report.add_meta(meta)
                rate.add(int(ids.shape[0]))
            tell()

        tell(force=True)
        # No answers yet (a dataset not run): nothing to open; responses.jsonl may not exist.
        records = _read_records(responses, offsets) if offsets else iter(())
        if pool is None and (n_workers <= 1 or total < INLINE_MAX):
            _init_worker(spec)
            for batch in _batches(records):
                land(reconstruct_batch(batch))
        elif total:
            own = pool is None
            if own:
                pool = worker_pool(config, n_workers)
            assert pool is not None
            inflight: deque[concurrent.futures.Future[list[Result]]] = deque()
            try:
                for batch in _batches(records):
                    inflight.append(pool.submit(reconstruct_batch, batch))
                    # Commit in submission order, a bounded number of batches ahead.
                    while len(inflight) >= 2 * n_workers:
                        land(inflight.popleft().result())
                while inflight:
                    land(inflight.popleft().result())
            finally:
                for fut in inflight:
                    fut.cancel()
                if own:
                    pool.shutdown(wait=True)
    write_report(folder, report)
    tell("done", force=True)
    return report


def worker_pool(config: Config, workers: int | None = None) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool whose workers each hold the config's tokenizer and template."""
    spec = WorkerSpec.from_config(config)
    spec.load()  # a tokenizer error is raised here, clearly, not as a broken pool
    return _new_pool(spec, workers or config.engine.workers or _cores())


def tokens_command(config: Config) -> int:
    """`draftgen tokens CONFIG`: reconstruct every dataset, print the validation report."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    reports = []
    workers = config.engine.workers or _cores()
    pool = worker_pool(config, workers) if workers > 1 else None  # one pool for every dataset
    try:
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                 console=console, transient=True) as bar:
            for ds in config.datasets:
                task = bar.add_task(escape(ds.name), total=None)

                def show(p: StageProgress, task: Any = task) -> None:
                    bar.update(task, completed=p.done, total=p.total or None)
                reports.append(reconstruct_dataset(config, ds.name, show, workers=workers, pool=pool))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # Names and paths are the user's text, not rich markup ("B[/x]" must print, not raise).
    table = Table(title=f"token reconstruction — {escape(str(config.run_dir))}", box=None, header_style="bold")
    table.add_column("dataset", no_wrap=True)
    for col in ("answers", "valid", "invalid", "trunc.", "Δ mean", "p50 |Δ|", "p99 |Δ|", "exact"):
        table.add_column(col, justify="right", no_wrap=True)
    total = ValidationReport.combine(reports)
    for i, r in enumerate([*reports, total]):
        counted = r.counted > 0
        table.add_row(escape(r.name), f"{r.checked:,}", f"{r.valid:,}", f"{r.checked - r.valid:,}", f"{r.truncated:,}",
                      f"{r.diff_mean:+.2f}" if counted else "-",
                      str(r.diff_abs_percentile(50)) if counted else "-",
                      str(r.diff_abs_percentile(99)) if counted else "-",
                      f"{r.share_exact:.1%}" if counted else "-", end_section=i == len(reports) - 1)
    console.print(table)
    for r in reports:
        failed = ", ".join(f"{c} {r.failures[c]:,}" for c in CHECKS if r.failures.get(c))
        if failed:
            console.print(f"{escape(r.name)}: failed checks: {failed}")
    console.print("Δ = reconstructed answer tokens - billed completion_tokens. Reports: "
                  f"{escape(str(RunDir(config.run_dir).root))}/<dataset>/tokens/{REPORT_FILE}")
    return 0


# ---------------------------------------------------------------------------------------------
# During `run`


class LiveReconstructor:
    """Reconstructs answers as the engine lands them, in worker processes.

    `submit` never blocks: answers are batched (briefly) and handed to the pool; results are appended
    to the dataset's TokenWriter from the event loop thread as they come back. A batch lost to a
    dead worker is not retried here: those answers stay in responses.jsonl and the next `catch_up`
    or `draftgen tokens` picks them up.
    """

    FLUSH_AFTER_S = 0.05

    def __init__(self, config: Config, workers: int = 0) -> None:
        self.config = config
        # Leave a core to the event loop unless told otherwise.
        self.workers = workers or max(1, _cores() - 1)
        self._spec = WorkerSpec.from_config(config)
        self._run = RunDir(config.run_dir)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._writers: dict[str, TokenWriter] = {}
        self._reports: dict[str, ValidationReport] = {}
        self._known: dict[str, set[str]] = {}        # ids committed or on their way, per dataset
        self._buffers: dict[str, list[dict[str, Any]]] = {}
        self._buffer_chars: dict[str, int] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Future[Any]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._rate = _Rate()
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
        pool = _new_pool(self._spec, self.workers)
        # Start every worker (and load its tokenizer) now, off the event loop.
        for fut in [pool.submit(_ping) for _ in range(self.workers)]:
            fut.result()
        self._pool = pool

    def _open(self, name: str) -> TokenWriter:
        writer = self._writers.get(name)
        if writer is None:
            folder = self._run.tokens(name)
            writer = self._writers[name] = _LockedWriter(folder)
            self._reports[name] = index_report(folder, name)
            self._known[name] = set(writer.ids)
            self._buffers[name] = []
            self._buffer_chars[name] = 0
        return writer

    # -- intake ---------------------------------------------------------------------------------

    def submit(self, dataset_name: str, record: dict[str, Any]) -> None:
        """Queue one answered record for reconstruction; returns at once."""
        if self._pool is None or self._loop is None or self._closed:
            raise RuntimeError("LiveReconstructor.submit before start() or after close()")
        if dataset_name not in self._writers:
            self._open(dataset_name)
        rid = str(record.get("id"))
        known = self._known[dataset_name]
        if rid in known:
            return
        known.add(rid)
        self._submitted += 1
        slim = _slim(record)
        self._buffers[dataset_name].append(slim)
        self._buffer_chars[dataset_name] += _record_chars(slim)
        if len(self._buffers[dataset_name]) >= BATCH_ANSWERS or self._buffer_chars[dataset_name] >= BATCH_CHARS:
            self._flush(dataset_name)
        elif self._flush_handle is None:
            self._flush_handle = self._loop.call_later(self.FLUSH_AFTER_S, self._flush_all)

    def _flush_all(self) -> None:
        self._flush_handle = None
        for name in list(self._buffers):
            self._flush(name)

    def _flush(self, name: str) -> None:
        batch = self._buffers[name]
        if not batch:
            return
        self._buffers[name] = []
        self._buffer_chars[name] = 0
        assert self._loop is not None and self._pool is not None
        try:
            fut = self._loop.run_in_executor(self._pool, reconstruct_batch, batch)
        except RuntimeError as e:  # the pool broke earlier (BrokenProcessPool is a RuntimeError)
            self._lose(name, batch, e)
            return
        self._inflight.add(fut)
        fut.add_done_callback(partial(self._landed, name, batch))

    def _lose(self, name: str, batch: list[dict[str, Any]], exc: BaseException) -> None:
        self._error = f"token reconstruction stopped: {exc}"
        self._lost += len(batch)
        for rec in batch:
            self._known[name].discard(str(rec.get("id")))

    def _landed(self, name: str, batch: list[dict[str, Any]], fut: asyncio.Future[list[Result]]) -> None:
        self._inflight.discard(fut)
        if fut.cancelled():
            self._lose(name, batch, RuntimeError("cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._lose(name, batch, exc)
            return
        writer, report = self._writers[name], self._reports[name]
        for rid, ids, mask, meta in fut.result():
            try:
                writer.append(rid, ids, mask, meta)
            except Exception as e:  # a full disk: stop counting it as done, say so
                self._lose(name, [{"id": rid}], e)
                continue
            report.add_meta(meta)
            self._rate.add(int(ids.shape[0]))

    # -- catching up with what is on disk -----------------------------------------------------------

    async def catch_up(self, dataset_name: str) -> int:
        """Queue every answer of `dataset_name` already on disk but not yet in its tokens folder
        (e.g. after a crash); returns how many. The work continues in the background; `wait_idle`
        or `close` waits for it."""
        _check_dataset(self.config, dataset_name)
        if dataset_name not in self._writers:
            self._open(dataset_name)
        responses = self._run.responses(dataset_name)
        offsets = await asyncio.to_thread(_pending, responses, set(self._known[dataset_name]))
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
                records = await asyncio.to_thread(lambda: list(_read_records(responses, part)))
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
        while self._tasks or self._inflight or any(self._buffers.values()):
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._flush_all()
            if self._inflight:
                await asyncio.wait(set(self._inflight))

    # -- views ----------------------------------------------------------------------------------------

    def report(self, dataset_name: str | None = None) -> ValidationReport:
        """One dataset's report (every answer in its tokens folder), or all datasets' with None."""
        if dataset_name is None:
            return ValidationReport.combine(self._reports.values())
        if dataset_name not in self._reports:
            return ValidationReport(dataset_name)
        return self._reports[dataset_name]

    def progress(self) -> StageProgress:
        done = self._rate.answers
        per_s, tok_s = self._rate.per_s()
        waiting = self._submitted - done - self._lost
        state = "failed" if self._error else ("done" if self._closed else "running")
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
            for name, writer in self._writers.items():
                writer.close()
                write_report(self._run.tokens(name), self._reports[name])
            if pool is not None:
                pool.shutdown(wait=True)
        await asyncio.to_thread(finish)
