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

from draftgen.core.errors import DiskError

TMP_MARK = ".tmp-"
# Owner-only: run files hold answers, spend and events another local user has no business reading
# (the umask can only take more away; `draftgen` itself runs under umask 077, cli/main.py).
FILE_MODE = 0o600
DIR_MODE = 0o700


def disk_error(path: Path, exc: OSError) -> DiskError:
    reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the disk is read-only",
              errno.EFBIG: "the file is too large (file size limit)", errno.EDQUOT: "disk quota exceeded",
              errno.EIO: "I/O error"}.get(exc.errno or 0, exc.strerror or str(exc))
    return DiskError(f"cannot write {path}: {reason}")


def temp_beside(path: Path) -> Path:
    """The temporary file `replacing(path)` writes: hidden, beside `path`, named by this process."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def replacing(path: Path, *, fsync: bool = False) -> Iterator[BinaryIO]:
    """Write the new content of `path` to the file yielded; it replaces `path` when the block ends
    without an exception. `fsync`: on disk before the rename (a power cut then never leaves an empty
    file that looks complete)."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
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
