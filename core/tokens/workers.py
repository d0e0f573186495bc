"""Reconstruction of whole datasets (`draftgen tokens`), and the worker pool it shares with the live
reconstruction of a run (core/tokens/during_run.py).

Both read `<run>/<dataset>/responses.jsonl`, skip every id already committed to
`<dataset>/tokens/index.jsonl`, and append the rest with `TokenWriter` (core/tokens/store.py; index
metadata as documented in core/records.py), so they are incremental and resumable: a crash leaves at
most a torn index line, which the writer cuts off on reopening. `<dataset>/tokens/report.json` holds
the `ValidationReport` of every answer in the folder.

Tokenization runs in worker processes (each loads the tokenizer once, in its initializer) on
batches of answers, so all cores work and the event loop of a live run never waits on it.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import multiprocessing
import os
import signal
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.files import disk_error, lock_file, write_json_atomic
from draftgen.core.live.progress import ProgressCallback, Throttle
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.quoting import sh_path
from draftgen.core.rundir import RunDir, iter_jsonl, read_line_at
from draftgen.core.tokens.fidelity import ProviderFlag
from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import (
    DEFAULT_COUNT_TOLERANCE,
    U32,
    Answer,
    PromptTexts,
    answer_fields,
    reconstruct_answer,
    unrenderable,
)
from draftgen.core.tokens.report import ValidationReport
from draftgen.core.tokens.store import INDEX_FILE, TokenWriter, meta_json
from draftgen.core.tokens.template import ChatTemplate, load_template
from draftgen.core.tokens.tokenizer import Tokenizer, load_tokenizer

REPORT_FILE = "report.json"
LOCK_FILE = "writer.lock"     # flock'ed by the one process writing the folder
BATCH_ANSWERS = 32            # answers per worker task: amortises IPC without starving cores
BATCH_CHARS = 1 << 20         # ... or fewer when they are long
INLINE_MAX = 32               # fewer pending answers than this: not worth starting processes
LITTLE_ENDIAN = sys.byteorder == "little"  # a Reconstruction's ids are the machine's order, the files little-endian

# A batch's outcome as a worker sends it back: every answer's input_ids (little-endian uint32) and
# loss mask (uint8), concatenated in the batch's order; each answer's (id, length in tokens, index
# metadata already JSON: `meta_json`); and the batch's ValidationReport, its answers counted by the
# worker. Two byte strings, a byte string an answer and one report cross the pipe, not two arrays and
# a dict an answer: the main process writes the bytes as they are (TokenWriter.append_encoded) and
# merges one report a batch, so what it does an answer is an index line's offset and little more.
Results = tuple[bytes, bytes, list[tuple[str, int, bytes]], ValidationReport]


# ---------------------------------------------------------------------------------------------
# Worker side


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker process builds its tokenizer and template (picklable)."""
    tokenizer_path: str
    trust_remote_code: bool
    template: str
    count_tolerance: int = DEFAULT_COUNT_TOLERANCE
    default_system: str | None = None
    prompt_specials: bool = False
    policy: SamplePolicy = field(default_factory=SamplePolicy)  # what a batch's report keeps and drops

    @classmethod
    def from_config(cls, config: Config) -> WorkerSpec:
        t = config.tokenizer
        return cls(t.path, t.trust_remote_code, t.template, config.validation.count_tolerance, t.system_turn(),
                   t.prompt_specials(config.api.server.kind.specials_as_tokens))

    def load(self) -> tuple[Tokenizer, ChatTemplate]:
        tok = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
        return tok, load_template(self.template, tok, default_system=self.default_system,
                                  prompt_specials=self.prompt_specials)


def worker_spec(config: Config) -> WorkerSpec:
    """The config's WorkerSpec with its sample policy, which each batch's report is judged by."""
    return replace(WorkerSpec.from_config(config), policy=SamplePolicy.from_config(config))


_worker: tuple[Tokenizer, ChatTemplate, int, SamplePolicy, PromptTexts] | None = None


def _init_worker(spec: WorkerSpec) -> None:
    global _worker
    tok, template = spec.load()
    _worker = (tok, template, spec.count_tolerance, spec.policy, PromptTexts(tok))


def _init_pool_worker(spec: WorkerSpec) -> None:
    """A pool worker's initializer: tied to the process that made the pool, deaf to the terminal.

    Ctrl-C, a closed tmux pane and `kill -TERM -PGID` signal the whole process group: the main
    process drains and then stops its workers itself, so a worker must not die first (its batch
    would be lost and the pool broken). So a worker leaves that group for one of its own. SIGTERM
    still ends it: it is how the pool stops the other workers when one dies (a worker left blocked
    on the queue lock the dead one held would never exit, and the run would hang at its end). And
    when the main process dies (kill -9, the OOM killer) a worker blocked on the pool's queue would
    wait forever, keeping the forkserver and the resource tracker alive with it, each holding a
    tokenizer: it exits as soon as its parent is gone."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        os.setpgid(0, 0)
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a warning written to the terminal must not stop it
        # The forkserver passed on the run's blocked mask; a SIGTERM pending since the fork (the pool's,
        # or rarely the group's) is delivered now, not dropped: a dead worker is replaced, a hang is not.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

        def exit_with_parent() -> None:
            parent.join()  # returns when the parent's end of the pipe closes: it has exited
            os._exit(0)
        threading.Thread(target=exit_with_parent, name="draftgen-parent-watch", daemon=True).start()
    _init_worker(spec)


def ping(_: object = None) -> bool:
    return _worker is not None


def reconstruct_batch(records: list[Answer]) -> Results:
    """The answers' token ids, loss masks, index metadata and report, in order (runs in a worker; see Results).
    `records`: each a response line's `answer_fields` (the rest of the line never crosses to a worker)."""
    assert _worker is not None, "reconstruct_batch runs in a worker started with _init_worker"
    tok, template, tolerance, policy, texts = _worker
    ids = array(U32)  # every answer's ids, appended as they are made (one copy each, one bytes at the end)
    masks = bytearray()
    samples: list[tuple[str, int, bytes]] = []
    report = ValidationReport("", policy=policy)
    for rec in records:
        try:
            r = reconstruct_answer(tok, template, rec, count_tolerance=tolerance, texts=texts)
        except Exception as e:  # one odd answer must not sink its batch: it is flagged, the rest go on
            r = unrenderable(f"{type(e).__name__}: {e}")
        ids += r.ids
        masks += r.mask
        samples.append((str(rec[0]), len(r.ids), meta_json(r.index_meta())))
        report.add(r)
    if not LITTLE_ENDIAN:  # the files hold little-endian ids
        ids.byteswap()
    return ids.tobytes(), bytes(masks), samples, report


def each_sample(results: Results) -> Iterator[tuple[str, np.ndarray, np.ndarray, dict[str, Any]]]:
    """(id, input_ids, loss_mask, metadata) of each answer of a batch's Results, as views of its buffers."""
    ids, masks, samples, _ = results
    all_ids, all_masks = np.frombuffer(ids, "<u4"), np.frombuffer(masks, np.uint8)
    start = 0
    for rid, length, meta in samples:
        yield (rid, all_ids[start:start + length], all_masks[start:start + length],
               orjson.loads(b"{" + meta[1:]) if meta != b"}" else {})  # meta_json's text as a dict again
        start += length


def record_chars(rec: Answer) -> int:
    """About how much text an answer holds (its batch's bound, BATCH_CHARS)."""
    messages, reasoning, content = rec[1], rec[2], rec[3]  # no slice, no generator: the main process counts each
    n = (len(reasoning) if isinstance(reasoning, str) else 0) + (len(content) if isinstance(content, str) else 0)
    for m in messages if isinstance(messages, list) else ():
        c = m.get("content") if isinstance(m, dict) else None
        n += len(c) if isinstance(c, str) else 64
    return n


def _batches(records: Iterable[Answer]) -> Iterator[list[Answer]]:
    batch: list[Answer] = []
    chars = 0
    for rec in records:
        batch.append(rec)
        chars += record_chars(rec)
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


def new_pool(spec: WorkerSpec, workers: int) -> concurrent.futures.ProcessPoolExecutor:
    # forkserver, not fork: the live run forks from a process with an event loop and threads.
    ctx = multiprocessing.get_context("forkserver")
    _start_helpers()
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_pool_worker,
                                               initargs=(spec,))


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Shared bookkeeping


class TokensBusy(DraftgenError):
    """Another process is writing the tokens folder."""


class WorkerDied(DraftgenError):
    """A reconstruction worker process died under `draftgen tokens`."""


class LockedWriter(TokenWriter):
    """A TokenWriter that holds an exclusive lock on its folder while open. Two writers would each
    append at the offsets they believe in (and the second one's opening repair truncates what the
    first is writing): `draftgen tokens` during a live `run` silently corrupted the token files.
    The lock goes with the process, so a crash never leaves it held."""

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        path = folder / LOCK_FILE
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise disk_error(path, e) from e
        fd = lock_file(path)
        if fd is None:
            raise TokensBusy(f"{folder}: another draftgen process is writing these token files (a live `draftgen "
                             "run` reconstructs its answers as they land); a second writer would corrupt them. "
                             "Wait until it has finished and run this again.")
        self._lock_fd = fd
        try:
            super().__init__(folder)  # only now: opening repairs (truncates) the files
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


def check_dataset(config: Config, name: str) -> None:
    if name not in _dataset_names(config):
        raise ConfigError(f"{config.path}: no dataset named {name!r} (datasets: {', '.join(_dataset_names(config))})")


def index_report(folder: Path, name: str, policy: SamplePolicy | None = None) -> ValidationReport:
    """The report of every sample committed in a tokens folder (read from its index metadata)."""
    report = ValidationReport(name, policy=policy or SamplePolicy())
    for _, entry in iter_jsonl(Path(folder) / INDEX_FILE):
        report.add_meta(entry)
    return report


def provider_flags(config: Config, report: ValidationReport) -> list[ProviderFlag]:
    """Providers whose token counts depart from the others' in `report` (thresholds from [validation])."""
    v = config.validation
    routing = config.request.get("provider")
    ignore = routing.get("ignore") if isinstance(routing, dict) else None
    ignore = [str(x) for x in ignore] if isinstance(ignore, list) else ([ignore] if isinstance(ignore, str) else [])
    return report.flags(v.provider_min_answers, v.provider_exact_gap, ignore, config.merge.exclude_providers,
                        v.min_exact_share)


def write_report(folder: Path, report: ValidationReport, flags: Iterable[ProviderFlag] = ()) -> Path:
    """`<tokens>/report.json`, replaced atomically."""
    path = Path(folder) / REPORT_FILE
    write_json_atomic(path, report.to_dict(flags))
    return path


class TokenRate:
    """Answers and tokens per second since the first one, for progress lines."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.answers = 0
        self.tokens = 0

    def add(self, tokens: int, answers: int = 1) -> None:
        self.answers += answers
        self.tokens += tokens

    def per_s(self) -> tuple[float, float]:
        dt = max(1e-6, time.monotonic() - self.t0)
        return self.answers / dt, self.tokens / dt


# ---------------------------------------------------------------------------------------------
# `draftgen tokens`: one dataset, on disk


def pending_offsets(responses: Path, done: set[str]) -> list[int]:
    """Offsets of the response lines whose id has no tokens yet (first occurrence of an id only)."""
    offsets, seen = [], set(done)
    for offset, rec in iter_jsonl(responses):
        rid = str(rec.get("id"))
        if rid not in seen:
            seen.add(rid)
            offsets.append(offset)
    return offsets


def read_records(responses: Path, offsets: Iterable[int]) -> Iterator[Answer]:
    with open(responses, "rb") as f:
        for offset in offsets:
            yield answer_fields(read_line_at(f, offset))


def reconstruct_dataset(config: Config, dataset_name: str, progress: ProgressCallback | None = None, *,
                        workers: int | None = None,
                        pool: concurrent.futures.ProcessPoolExecutor | None = None) -> ValidationReport:
    """Reconstruct every answer of `dataset_name` not yet in its tokens folder; the folder's full report.

    `workers`: processes to use (default: config.engine.workers, 0 meaning one per core). `pool`: a
    pool made by `worker_pool` to share between datasets (else one is started when worth it).
    """
    check_dataset(config, dataset_name)
    run = RunDir(config.run_dir)
    responses, folder = run.responses(dataset_name), run.tokens(dataset_name)
    spec = worker_spec(config)
    n_workers = workers if workers is not None else (config.engine.workers or cores())
    with LockedWriter(folder) as writer:
        report = index_report(folder, dataset_name, SamplePolicy.from_config(config))
        offsets = pending_offsets(responses, writer.ids)
        total = len(offsets)
        rate = TokenRate()
        throttle = Throttle()

        def tell(state: StageState = StageState.RUNNING, force: bool = False) -> None:
            if progress is None or not throttle.due(force):
                return
            per_s, tok_s = rate.per_s()
            left = total - rate.answers
            progress(StageProgress(
                name="tokens", state=state, done=rate.answers, total=total, rate=per_s, rate_unit="answers/s",
                eta_s=left / per_s if per_s > 0 and left else None,
                detail=(("dataset", dataset_name), ("valid", f"{report.valid:,}/{report.checked:,}"),
                        ("tokens/s", f"{tok_s:,.0f}")),
                message=f"{dataset_name}: {rate.answers:,}/{total:,} answers reconstructed"))

        def land(results: Results) -> None:
            ids, masks, samples, batch_report = results
            writer.append_encoded(ids, masks, samples)
            report.merge(batch_report)
            rate.add(len(masks), len(samples))
            tell()

        tell(force=True)
        # No answers yet (a dataset not run): nothing to open; responses.jsonl may not exist.
        records = read_records(responses, offsets) if offsets else iter(())
        if pool is None and (n_workers <= 1 or total < INLINE_MAX):
            _init_worker(spec)
            for batch in _batches(records):
                land(reconstruct_batch(batch))
        elif total:
            own = pool is None
            if own:
                pool = worker_pool(config, n_workers)
            assert pool is not None
            inflight: deque[concurrent.futures.Future[Results]] = deque()
            try:
                for batch in _batches(records):
                    inflight.append(pool.submit(reconstruct_batch, batch))
                    # Commit in submission order, a bounded number of batches ahead.
                    while len(inflight) >= 2 * n_workers:
                        land(inflight.popleft().result())
                while inflight:
                    land(inflight.popleft().result())
            except concurrent.futures.process.BrokenProcessPool:
                raise WorkerDied(f"{dataset_name}: a token reconstruction worker process died (killed, or out of "
                                 f"memory); {rate.answers:,} of {total:,} answers were reconstructed and are kept. "
                                 f"Run `draftgen tokens {sh_path(config.path)}` again to finish") from None
            finally:
                for fut in inflight:
                    fut.cancel()
                if own:
                    pool.shutdown(wait=True)
    write_report(folder, report, provider_flags(config, report))
    tell(StageState.DONE, force=True)
    return report


def worker_pool(config: Config, workers: int | None = None) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool whose workers each hold the config's tokenizer and template."""
    spec = worker_spec(config)
    spec.load()  # a tokenizer error is raised here, clearly, not as a broken pool
    return new_pool(spec, workers or config.engine.workers or cores())
