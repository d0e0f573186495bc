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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.rundir import iter_jsonl

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


@dataclass
class SpoolRecord:
    dataset: str
    file: str                  # "responses" or "failures"
    record: dict[str, Any]


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
            folder.mkdir(parents=True, exist_ok=True)
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


def find_spools(run_root: Path) -> list[Spool]:
    """The spool files written for this run directory, oldest first, read."""
    key = run_key(run_root)
    resolved = str(Path(run_root).resolve())
    seen: set[Path] = set()
    out: list[Spool] = []
    for folder in spool_dirs():
        with contextlib.suppress(OSError):
            for path in sorted(folder.glob(f"{key}-*.jsonl")):
                if path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                spool = Spool(path)
                try:
                    lines = [obj for _, obj in iter_jsonl(path)]
                except OSError as e:
                    spool.problem = f"cannot read it: {e}"
                    out.append(spool)
                    continue
                if not lines or lines[0].get("draftgen_spool") != VERSION or lines[0].get("run_dir") != resolved:
                    continue  # another directory's (a hash collision) or not ours
                for obj in lines[1:]:
                    if obj.get("file") in ("responses", "failures") and isinstance(obj.get("record"), dict):
                        spool.records.append(SpoolRecord(str(obj.get("dataset")), obj["file"], obj["record"]))
                out.append(spool)
    return out
