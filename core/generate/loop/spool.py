"""The spool: where records the run directory's disk refused go when the run ends without room.

Records held in memory (ledger.py) are paid for: when the run must end before the disk takes them
(stop now, a second SIGINT, "spool now" in the quit dialog) they are written whole, as JSONL and
fsynced, to the first place that takes them: $DRAFTGEN_SPOOL_DIR, else `draftgen-spool` under the
temp directory, else `~/.draftgen-spool`. The file is named by the run directory (its name and a hash
of its absolute path) and the time. The next `draftgen run` of that directory imports every spooled
record into its dataset's responses.jsonl or failures.jsonl (an id already there is not written
again), fsyncs them, and only then removes the spool file; a spool it cannot import stays.

Line 1 is a header {"draftgen_spool": 1, "run_dir": ...}; then one {"dataset", "file", "record"}
per record, "file" being "responses" or "failures".

Only the user's own spools are read: another local user could otherwise plant "answers" (the temp
directory is writable by all). A spool place must be a folder owned by the user that no one else can
write (a symbolic link to one counts only if the link is the user's too); draftgen creates it 0700
and checks it when it exists already, writing elsewhere when it fails. A spool file must be a regular
file of the user's, opened without following a symbolic link (O_NOFOLLOW) and checked on the open
descriptor. A file that fails either check is not read; the run names it, with why (`Spool.refused`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.files import DIR_MODE
from draftgen.core.rundir import jsonl_objects

SPOOL_ENV = "DRAFTGEN_SPOOL_DIR"
VERSION = 1


def spool_dirs() -> list[Path]:
    """Where a spool may go, in the order tried."""
    out = []
    if os.environ.get(SPOOL_ENV):
        out.append(Path(os.environ[SPOOL_ENV]).expanduser())
    out.append(Path(tempfile.gettempdir()) / "draftgen-spool")
    out.append(Path.home() / ".draftgen-spool")
    return out


def run_key(run_root: Path) -> str:
    """The run directory's part of a spool file's name: readable, and unique per absolute path."""
    resolved = str(Path(run_root).resolve())
    return f"{Path(resolved).name or 'run'}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"


def unsafe_place(folder: Path) -> str:
    """Why `folder` is no place to read or write spools ("" when it is one): not a folder, not the user's
    (nor, for a symbolic link, the link itself), or writable by its group or others. OSError when it
    cannot be looked at (FileNotFoundError: there is none)."""
    me = os.geteuid()
    link = os.lstat(folder)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
        return f"it is a symbolic link owned by uid {link.st_uid}, not by you (uid {me})"
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != me:
        return f"it is owned by uid {st.st_uid}, not by you (uid {me})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


@dataclass
class SpoolRecord:
    dataset: str
    file: str                  # "responses" or "failures"
    record: Mapping[str, Any]  # a ResponseLine or FailureLine written; read back, a JSON object unchecked


def write_spool(run_root: Path, records: list[SpoolRecord]) -> tuple[Path | None, list[str]]:
    """Write every record to the first spool directory that takes them all, fsynced; (its path, the
    reasons the others refused). (None, reasons) when none did: the caller says they are lost."""
    header = {"draftgen_spool": VERSION, "run_dir": str(Path(run_root).resolve()), "ts": round(time.time(), 3)}
    data = b"".join(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for obj in
                    [header, *({"dataset": r.dataset, "file": r.file, "record": r.record} for r in records)])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    refused: list[str] = []
    for folder in spool_dirs():
        path = folder / f"{run_key(run_root)}-{stamp}-{os.getpid()}.jsonl"
        try:
            folder.mkdir(DIR_MODE, parents=True, exist_ok=True)
            if why := unsafe_place(folder):
                refused.append(f"{folder}: {why}")
                continue
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(28, "no bytes written")
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):  # the name itself durable too
                dfd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return path, refused
        except OSError as e:
            refused.append(f"{folder}: {e.strerror or e}")
            with contextlib.suppress(OSError):
                path.unlink()  # a half-written spool is never left to be imported
    return None, refused


@dataclass
class Spool:
    """One spool file of this run directory, read whole."""
    path: Path
    records: list[SpoolRecord] = field(default_factory=list)
    problem: str = ""          # why it cannot be imported (then it stays)
    refused: str = ""          # why it was not even read: not the user's, or in a place others can write


def find_spools(run_root: Path) -> list[Spool]:
    """The spool files written for this run directory, oldest first, read; those in a place that is not
    the user's alone, or not the user's own regular files, refused unread."""
    key = run_key(run_root)
    resolved = str(Path(run_root).resolve())
    seen: set[Path] = set()
    out: list[Spool] = []
    for folder in spool_dirs():
        try:
            unsafe = unsafe_place(folder)
            paths = sorted(folder.glob(f"{key}-*.jsonl"))
        except OSError:
            continue  # no such place (or none we can look into): nothing of ours there
        for path in paths:
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            if unsafe:
                out.append(Spool(path, refused=f"its folder {folder} is not yours alone: {unsafe}"))
                continue
            spool, lines = _read_own(path)
            if spool.refused or spool.problem:
                out.append(spool)
                continue
            if not lines or lines[0].get("draftgen_spool") != VERSION or lines[0].get("run_dir") != resolved:
                continue  # another directory's (a hash collision) or not ours
            for obj in lines[1:]:
                if obj.get("file") in ("responses", "failures") and isinstance(obj.get("record"), dict):
                    spool.records.append(SpoolRecord(str(obj.get("dataset")), obj["file"], obj["record"]))
            out.append(spool)
    return out


def _read_own(path: Path) -> tuple[Spool, list[dict[str, Any]]]:
    """The spool file at `path` and its lines, parsed, read only if it is a regular file of the
    user's: opened without following a symbolic link, checked on the descriptor it is read from."""
    spool = Spool(path)
    lines: list[dict[str, Any]] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            spool.refused = "it is a symbolic link"
        else:
            spool.problem = f"cannot read it: {e.strerror or e}"
        return spool, lines
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        me = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            spool.refused = "it is not a regular file"
        elif st.st_uid != me:
            spool.refused = f"it is owned by uid {st.st_uid}, not by you (uid {me})"
        else:
            try:
                lines = [obj for _, obj in jsonl_objects(f)]
            except OSError as e:
                spool.problem = f"cannot read it: {e.strerror or e}"
    return spool, lines
