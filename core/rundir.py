"""The run directory and its append-only JSONL files.

    <output.dir>/
      run.json                    config snapshot (no secrets), request fingerprint, versions
      smoke.json                  last smoke result with its fingerprint
      events.log                  human-readable log
      history.jsonl               one line per interval: answers, tokens, spend, errors, in flight
                                  (core/live/timeline.py)
      attach.sock                 Unix socket for `draftgen attach` (owner-only), while a run is live
      <dataset>/responses.jsonl   one line per answered prompt (record fields: see core/records.py)
      <dataset>/failures.jsonl    one line per prompt that failed for good, with the last error
      <dataset>/rejected.jsonl    input lines that could not be used
      <dataset>/tokens/           token ids, loss mask, validation flags (core/tokens/store.py)
      merged/                     train.jsonl, tokens/, train-tokens.jsonl, stats.json (core/merge/merge.py)
      hidden_states/              SpecForge offline format (core/extract/)

Files are created 0600 and folders 0700 (owner-only, core/files.py FILE_MODE and DIR_MODE). A run,
and every command that writes into the directory (cli/main.py `_config_to_write`), refuses a directory
other users can write, or one under a folder they can write that has no sticky bit, or under a folder or
symbolic link another user owns (core/private_dir.py `check_private`), unless `[output] shared = true`
says it is shared on purpose.
A JSONL line is written whole with one write() and fsynced (group commit, `JsonlAppender.synced`)
before the answer counts as acknowledged. On reopening, a torn last line (a crash mid-write) is cut
off and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen.core.errors import DiskError
from draftgen.core.files import DIR_MODE, FILE_MODE, disk_error

DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EFBIG, errno.EDQUOT, errno.EIO}


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def smoke_json(self) -> Path:
        return self.root / "smoke.json"

    @property
    def events_log(self) -> Path:
        return self.root / "events.log"

    @property
    def history(self) -> Path:
        return self.root / "history.jsonl"

    @property
    def spend(self) -> Path:
        return self.root / "spend.jsonl"

    @property
    def socket(self) -> Path:
        return self.root / "attach.sock"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    def dataset(self, name: str) -> Path:
        return self.root / name

    def responses(self, name: str) -> Path:
        return self.root / name / "responses.jsonl"

    def failures(self, name: str) -> Path:
        return self.root / name / "failures.jsonl"

    def rejected(self, name: str) -> Path:
        return self.root / name / "rejected.jsonl"

    def tokens(self, name: str) -> Path:
        return self.root / name / "tokens"


def repair_torn_tail(path: Path) -> int:
    """Cut a half-written last line; return how many bytes were cut (0 if the file was whole)."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb") as f:
        # Walk back to the last newline; a torn line is at most one record long.
        block = 1 << 16
        pos = size
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            if pos == size and chunk.endswith(b"\n"):
                return 0
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
    os.truncate(path, keep)
    return size - keep


# Group commit's cadence: fsyncs of one file begin at most this often (20 ms beside requests that take
# seconds; at hundreds of answers a second it turns one fsync, and one thread hand-off, per handful of
# answers into one per dozens: each costs the event loop's process CPU in the kernel and in the hand-off).
SYNC_INTERVAL_S = 0.02
_LINE = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE  # a JSONL line's encoding


class JsonlAppender:
    """Appends whole JSON lines with one write each (a `kill -9` loses nothing written), and makes them
    durable against an OS crash on demand: `sync()` (fsync now) or `await synced()` (group commit: the
    lines of every caller that asked while the previous fsync ran share the next one, run in a thread so
    the event loop keeps serving). `fsync=True` fsyncs each append before it returns.

    `coalesce=True` (the spend ledger): an append inside a running event loop is buffered and the
    lines of one loop tick go out in one write at the tick's end, or sooner when an fsync begins
    (`sync`, `synced`: a fsync covers only what was written, so what is awaited is written first);
    outside a loop an append is written at once. A failed write keeps the lines buffered, in order,
    for the next one (`flush` raises it). With `on_flush` (the records, record_book.py) each write of
    the buffer tells its owner how many whole lines went out, and the error that refused the rest; the
    rest is then the owner's (held in memory), not retried here, and nothing is raised. `append_now`
    writes one line at once whatever the mode (raises DiskError), after what is buffered. With
    `before_write` (the spend ledger's generation ids, spend_file.py) its owner adds lines (`buffer`)
    to each write just before it is made; `write_soon` has the tick's write made with nothing buffered.
    With `on_sync_error` (the records, record_book.py) a group commit that failed is told to its owner
    once for each of its waiters, just before that waiter resumes, and the waiter's future resolves
    without the error: what the owner does about it (pause the run) is its caller's whole answer."""

    def __init__(self, path: Path, *, fsync: bool = False, coalesce: bool = False,
                 on_flush: Callable[[int, DiskError | None], None] | None = None,
                 before_write: Callable[[], None] | None = None,
                 on_sync_error: Callable[[DiskError], None] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(DIR_MODE, parents=True, exist_ok=True)
        self.cut_bytes = repair_torn_tail(self.path)
        self._fsync = fsync
        self._coalesce = coalesce and not fsync
        self._on_flush = on_flush if self._coalesce else None  # lines written, and the error that kept the rest
        self._before_write = before_write if self._coalesce else None  # the owner's late lines, buffered
        self._on_sync_error = on_sync_error  # told a failed group commit, for each of its waiters
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        self._written = 0    # appends written so far
        self._synced = 0     # of those, the ones an fsync has covered
        self._buf: list[bytes] = []    # coalesced lines not written yet (they follow the written ones)
        self._flush_due = False        # a tick-end flush is scheduled
        self._running = False
        self._batch: list[asyncio.Future[None]] = []  # callers waiting for the next fsync
        self._last_start = -SYNC_INTERVAL_S          # loop time the last fsync began

    def append(self, obj: Any) -> None:
        line = orjson.dumps(obj, option=_LINE)
        if self._coalesce:
            if self._flush_due or self.write_soon():  # the line joins this tick's write
                self._buf.append(line)
                return
            # No loop (a thread, a command): written at once, behind any buffered.
            if self._on_flush is not None:  # its owner hears how it went, as for a tick's lines
                self._buf.append(line)
                self.flush()
                return
            self.flush()
        self._write_line(line)

    def write_soon(self) -> bool:
        """Inside a running event loop (coalesce mode): the tick's write is scheduled for its end (also
        with nothing buffered, for `before_write` to add to); False outside a loop (or without coalescing)."""
        if self._flush_due:
            return True
        if not self._coalesce:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._flush_due = True
        loop.call_soon(self._flush_tick)
        return True

    def buffer(self, obj: Any) -> None:
        """A line added to the write being made (`before_write` only)."""
        self._buf.append(orjson.dumps(obj, option=_LINE))

    def append_now(self, obj: Any) -> None:
        """One line written before it returns (raises DiskError), after the buffered ones."""
        self.flush()
        self._write_line(orjson.dumps(obj, option=_LINE))

    def _write_line(self, line: bytes) -> None:
        written = 0
        try:
            while written < len(line):
                # After a short write (the disk filled mid-line, a file-size limit) the rest either
                # goes through or fails with the real reason (ENOSPC, EFBIG...).
                n = os.write(self._fd, line[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no bytes written")
                written += n
            self._written += 1
            if self._fsync:
                os.fsync(self._fd)
                self._synced = self._written
        except OSError as e:
            if 0 < written < len(line):
                # Take the partial line back out: a record is on disk whole or not at all.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)
            raise disk_error(self.path, e) from e

    def _flush_tick(self) -> None:
        self._flush_due = False
        with contextlib.suppress(DiskError):  # kept buffered: the next write, sync or close says it
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines now, in one write (raises DiskError; what did not go out stays buffered)."""
        if self._before_write is not None and self._fd >= 0:
            self._before_write()
        if not self._buf or self._fd < 0:
            return
        data = b"".join(self._buf) if len(self._buf) > 1 else self._buf[0]
        written = 0
        try:
            while written < len(data):
                n = os.write(self._fd, data[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no bytes written")
                written += n
        except OSError as e:
            # The whole lines that went out are written; a torn last one is taken back out.
            keep = data.rfind(b"\n", 0, written) + 1
            if written > keep:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - (written - keep))
            done = data.count(b"\n", 0, keep)
            del self._buf[:done]
            self._written += done
            refused = disk_error(self.path, e)
            if self._on_flush is None:
                raise refused from e
            self._buf.clear()  # the rest is its owner's now
            self._on_flush(done, refused)
            return
        done = len(self._buf)
        self._written += done
        self._buf.clear()
        if self._on_flush is not None:
            self._on_flush(done, None)

    @property
    def unsynced(self) -> bool:
        return bool(self._buf) or self._synced < self._written

    def sync(self) -> None:
        """Every line appended so far durable before it returns (raises DiskError)."""
        self.flush()
        target = self._written
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise disk_error(self.path, e) from e
        self._synced = max(self._synced, target)

    def synced(self) -> asyncio.Future[None]:
        """Resolves once an fsync begun after every line written so far has completed (DiskError when it
        failed, or, with `on_sync_error`, None once that was told it). Each caller gets its own future, so
        cancelling one waiter cancels no other."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._buf and self._synced >= self._written:  # not `unsynced`: a call saved for each waiter
            fut.set_result(None)
            return fut
        self._batch.append(fut)
        if not self._running:
            self._running = True
            self._start_soon()
        return fut

    def _start_soon(self) -> None:
        """The next fsync at most every SYNC_INTERVAL_S: at a high rate of answers each fsync then covers
        many of them (one journal commit, not one per handful), for at most that much added latency."""
        loop = asyncio.get_running_loop()
        wait = self._last_start + SYNC_INTERVAL_S - loop.time()
        if wait > 0:
            loop.call_later(wait, self._start)
        else:
            loop.call_soon(self._start)  # one tick's worth of callers share it

    def _start(self) -> None:
        batch, self._batch = self._batch, []
        loop = asyncio.get_running_loop()
        self._last_start = loop.time()
        if self._fd < 0:  # closed meanwhile: close() synced what it could write; the rest is not on disk
            self._finish(batch, self._written, DiskError(f"{self.path}: closed before {len(self._buf)} line(s) "
                                                         "could be written") if self._buf else None)
            return
        try:
            self.flush()  # what the waiters appended is written before the fsync that covers it begins
        except DiskError as e:
            self._finish(batch, self._written, e)
            return
        target = self._written
        try:
            fd = os.dup(self._fd)  # the thread's own descriptor: close() may run before its fsync ends
        except OSError as e:
            self._finish(batch, target, e)
            return
        job = loop.run_in_executor(None, _fsync_and_close, fd)
        job.add_done_callback(lambda f: self._finish(
            batch, target, asyncio.CancelledError() if f.cancelled() else f.exception()))

    def _finish(self, batch: list[asyncio.Future[None]], target: int, error: BaseException | None) -> None:
        if error is None:
            self._synced = max(self._synced, target)
            for fut in batch:
                if not fut.done():  # done: its waiter was cancelled
                    fut.set_result(None)
        else:
            told = self._on_sync_error
            for fut in batch:
                if fut.done():
                    continue
                if isinstance(error, asyncio.CancelledError):  # the loop is shutting its executor down
                    fut.cancel()
                    continue
                refused = disk_error(self.path, error) if isinstance(error, OSError) else error
                if told is not None and isinstance(refused, DiskError):
                    told(refused)
                    fut.set_result(None)
                else:
                    fut.set_exception(refused)
        if self._batch:  # callers that came while this fsync ran: the next one covers them
            self._start_soon()
        else:
            self._running = False

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(DiskError):  # lines a full disk still refuses are given up
                self.flush()
            if self._synced < self._written:  # a clean end leaves every line durable (gen, end, settle included)
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                    self._synced = self._written
            os.close(self._fd)
            self._fd = -1


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(byte offset, object) for each complete, parseable line; a torn or bad line is skipped."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        yield from jsonl_objects(f)


def jsonl_objects(f: BinaryIO) -> Iterator[tuple[int, dict[str, Any]]]:
    """iter_jsonl of a file already open (binary), from where it stands."""
    pos = 0
    for line in f:
        start, pos = pos, pos + len(line)
        if not line.endswith(b"\n"):
            return
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield start, obj


def read_line_at(f: Any, offset: int) -> dict[str, Any]:
    f.seek(offset)
    return orjson.loads(f.readline())


CONTINUED = "\n" + " " * 26  # a line of events.log after the first of its message: under the message


class EventLog:
    """events.log: one human-readable line per event, flushed as it happens."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(DIR_MODE, parents=True, exist_ok=True)
        self._f = open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE), "a", encoding="utf-8")

    def write(self, level: str, message: str, ts: float | None = None) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts or time.time()))
        # A message's further lines are indented under its first: no line of a server's text reads as an
        # event of its own (`draftgen attach` reads how the last run ended from the log's lines).
        message = message.replace("\n", CONTINUED)
        try:
            self._f.write(f"{stamp} {level.upper():5} {message}\n")
            self._f.flush()
        except OSError:
            pass  # the log is for people; a full disk is reported by the record writers

    def close(self) -> None:
        with contextlib.suppress(OSError):  # lines a full disk held back are given up, not raised
            self._f.close()
