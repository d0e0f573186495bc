"""Crash safety for merged/: one merge at a time, built aside, switched in by renames.

A merge builds `merged.tmp-<pid>/`, fsyncs it, then renames `merged/` → `merged.old-<ns>/` and the
new folder → `merged/`. A crash at any point leaves either the old merged/ or the new one; `recover`
(run under the lock before each merge) removes the leftovers and puts a lost merged/ back.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftgen.core.errors import DraftgenError
from draftgen.core.files import lock_file

LOCK_FILE, TMP_PREFIX, OLD_PREFIX = "merged.lock", "merged.tmp-", "merged.old-"


@contextmanager
def merge_lock(root: Path) -> Iterator[None]:
    path = root / LOCK_FILE
    fd = lock_file(path)
    if fd is None:
        raise DraftgenError(f"{root}: another merge or an extraction is running on this run directory "
                            f"(it holds {path}); wait for it to finish")
    try:
        yield
    finally:
        os.close(fd)


def _old_stamp(path: Path) -> int:
    try:
        return int(path.name.removeprefix(OLD_PREFIX))
    except ValueError:
        return -1


def recover(root: Path) -> None:
    """Undo what a crashed merge left: stale temp folders go; a lost merged/ comes back from merged.old-*.

    Call only while holding the merge lock (every other merge.tmp-* is then stale).
    """
    merged = root / "merged"
    for tmp in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(tmp, ignore_errors=True)
    olds = sorted(root.glob(OLD_PREFIX + "*"), key=_old_stamp)
    if not merged.exists() and olds:
        # The crash fell between moving the old merged/ aside and moving the new one in.
        os.rename(olds.pop(), merged)
        _fsync_dir(root)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Everything under `folder` on disk before the rename publishes it (a power cut included)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(sub)


def switch(tmp: Path, merged: Path) -> None:
    """merged → merged.old-<ns>, tmp → merged, then drop the old one; `recover` handles a crash between."""
    old = None
    if merged.exists():
        old = merged.with_name(f"{OLD_PREFIX}{time.time_ns()}")
        os.rename(merged, old)
    os.rename(tmp, merged)
    _fsync_dir(merged.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
