"""Writing files so that a crash or a full disk never leaves one half-written, and locking them.

- `replacing(path)` / `write_atomic` / `write_json_atomic`: the new content goes to a hidden
  temporary file beside `path` (`.<name>.tmp-<pid>`, so machines sharing a folder never collide)
  and is renamed over it: readers see the old file or the new one, never a mix. A failed write
  removes the temporary file, leaves the old one as it was and raises `DiskError` naming `path`.
- `lock_file(path)`: an exclusive `flock` taken without waiting. It goes with the process, so a
  crash never leaves it held.
- Files are created owner-only (`FILE_MODE`, 0600); folders made here are `DIR_MODE` (0700).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen.core.errors import DiskError, DraftgenError

TMP_MARK = ".tmp-"
# Owner-only: run files hold answers, spend and events another local user has no business reading
# (the umask can only take more away; `draftgen` itself runs under umask 077, cli/main.py).
FILE_MODE = 0o600
DIR_MODE = 0o700
# extract.group_readable: hidden states a training job running as another user of the group must read.
GROUP_FILE_MODE = 0o640
GROUP_DIR_MODE = 0o750


def disk_error(path: Path, exc: OSError) -> DiskError:
    reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the disk is read-only",
              errno.EFBIG: "the file is too large (file size limit)", errno.EDQUOT: "disk quota exceeded",
              errno.EIO: "I/O error"}.get(exc.errno or 0, exc.strerror or str(exc))
    return DiskError(f"cannot write {path}: {reason}")


def temp_beside(path: Path) -> Path:
    """The temporary file `replacing(path)` writes: hidden, beside `path`, named by this process."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def replacing(path: Path, *, fsync: bool = False, mode: int = FILE_MODE) -> Iterator[BinaryIO]:
    """Write the new content of `path` to the file yielded; it replaces `path` when the block ends
    without an exception. `fsync`: on disk before the rename (a power cut then never leaves an empty
    file that looks complete). `mode` other than FILE_MODE is set on the file itself (the umask
    would take the group's bits away at creation)."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
            if mode != FILE_MODE:
                os.fchmod(f.fileno(), mode)
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(path, e) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    with replacing(path, fsync=fsync) as f:
        f.write(data)


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as indented JSON (a newline at the end), replacing `path` whole."""
    write_atomic(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n")


def lock_file(path: Path) -> int | None:
    """Open `path` (created if need be) and lock it exclusively without waiting: the descriptor (close
    it to release the lock), or None when another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as e:
        raise disk_error(path, e) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------------------------------------
# Liveness: one rule for "a run is live in this directory"

RUN_LOCK = "run.lock"


class RunDirBusyError(DraftgenError):
    """Another process holds the run directory's run lock (`exclusive`)."""


class RunLock:
    """The run lock of one run directory, while held. Made by `exclusive`; see there."""

    def __init__(self, root: Path, what: str) -> None:
        self.root = Path(root)
        self.path = self.root / RUN_LOCK
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunDirBusyError naming the directory, the holder and what to do."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise disk_error(self.path, e) from e
        fd = lock_file(self.path)
        if fd is None:
            try:
                holder = self.path.read_text(errors="replace").strip()
            except OSError:
                holder = ""
            raise RunDirBusyError(
                f"{self.root}: a run is already live in this run directory, or another draftgen command that "
                f"writes its files ({holder or 'see ' + str(self.path)}); {self.what} cannot work beside it. Wait "
                f"for it to end or quit it (q in its window, SIGINT or SIGTERM to its process), then run "
                f"{self.what} again")
        try:  # who holds it, for the message above (best effort: the lock is the flock, not this text)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()}: {self.what}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)  # released even if a forked child still holds a copy
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def exclusive(root: Path, what: str) -> RunLock:
    """The run lock of run directory `root`: an exclusive `flock` on `<root>/run.lock`, taken without
    waiting (`with exclusive(root, "draftgen tokens"): ...`, or `.acquire()` / `.release()`).

    The liveness rule: a run directory is live while a process holds this lock, and only then (the
    attach socket is no test: it can be deleted under a live run, or left behind by a killed one).
    `draftgen run` (TUI, headless, demo: core/run/pipeline.py) holds it from its start until it has
    closed, live reconstruction and the merge/extract stages it runs included; the commands that
    rewrite files a run writes hold it while they work: `retry-failed` (failures.jsonl), `tokens`
    (<dataset>/tokens) and `smoke` (smoke.json, spend.jsonl). So each refuses while a run is live,
    and a run refuses to start while one of them works. The run's own stages (the `s`, `m`, `x`
    keys) run in its process under its lock and take nothing. `merge` and `extract` do not take it:
    merge reads a live run's files safely and builds merged/ under its own lock (core/merge/swap.py),
    and extraction writes only hidden_states/, which a run never touches. `draftgen ledger` beside a
    live run reads spend.jsonl without writing (the spend file's own lock, core/generate/money/spend_file.py).

    A flock goes with its process: a crash never leaves a directory looking live. It is taken on
    an open file, so a second take in the same process is refused too.
    """
    return RunLock(root, what)
