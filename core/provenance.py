"""`provenance.json`: what made an output folder, written beside merged/, hidden_states/ and the hand-off.

Each folder's file holds one record per command that wrote there, under its name:

    {"version": 1,
     "records": {"merge": {...}}}                         merged/provenance.json
     "records": {"extract": {...}, "train-command": {...}} hidden_states/provenance.json
                 ("extract shard I/N" for a `--shard I/N` run: machines share the folder)

A record says:

    command       the command line as given (sys.argv; the API key, were it there, cut out)
    draftgen      {"version", "commit"}: the git commit of draftgen's source when it is a git checkout
                  (`"dirty": true` when it has uncommitted changes), else commit null
    versions      python, torch, transformers, sglang, specforge: the installed distributions'
                  versions (never imported here), "absent" for one not installed
    config        {"path" as given, "sha256" of the file's bytes}
    inputs        the prompt files ({"path", "sha256"}), the merge id and samples digest
                  (core/tokens/identity.py), and what else the command read
    host          the machine's name
    started_at, ended_at   UTC, ISO 8601
    and what the command adds: the model (path, its config.json's sha256), layers, dtype, format...

Written atomically like every other output (core/files.py): readers see the old file or the new
one. merged/'s is written inside the merge's temporary folder, before it is fsynced and switched
in (core/merge/swap.py), so it is part of the all-or-nothing switch; it is not in the merge id,
which is the samples' digest alone. In hidden_states/ two commands may add their records at once
(extraction and `draftgen train-command`, shards on several machines): an flock on a lock file in the
folder's parent, named after it (`RUN/.hidden_states.provenance.lock`), makes each read-and-replace
whole. The lock is not in hidden_states/ itself, which holds only what a trainer or a user looks for,
and it is never removed (removing a lock file lets a third writer lock a new file while the second holds
the old one). Shards on several machines share the run directory (each reads merged/ from it), so the
lock file is on the same filesystem as the records; Linux's NFS client carries flock to the server
(as a whole-file POSIX lock, NFSv4 or NFSv3 with lockd). SpecForge's offline reader takes only `.ckpt`
files and speculators' only `hs_*.safetensors`: provenance.json is read as no sample.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from draftgen.core import __version__
from draftgen.core.files import FILE_MODE, disk_error, write_json_atomic

PROVENANCE_FILE = "provenance.json"
LOCK_SUFFIX = ".provenance.lock"  # RUN/.<folder>.provenance.lock: the lock of RUN/<folder>/provenance.json
ABSENT = "absent"
# The libraries that do the work: their versions as installed (import names differ: looked up by distribution).
LIBRARIES = ("torch", "transformers", "sglang", "specforge", "numpy", "safetensors")
GIT_TIMEOUT_S = 5.0
CHUNK = 1 << 20


def utc(ts: float) -> str:
    """`ts` (seconds since the epoch) as UTC ISO 8601, to the millisecond."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")


def file_sha256(path: Path) -> str | None:
    """The sha256 of a file's bytes; None when it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def json_sha256(obj: Any) -> str:
    """The sha256 of `obj` as JSON with sorted keys (a config read as a dict, not from a file)."""
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()


def versions() -> dict[str, str]:
    """Python's version and each of LIBRARIES' installed versions ("absent" when not installed)."""
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = ABSENT
    return out


def _source_root() -> Path:
    return Path(__file__).resolve().parent.parent


def git_commit(root: Path | None = None) -> dict[str, Any]:
    """{"commit", "dirty"} of draftgen's source when it is the top of a git checkout (an editable install);
    {"commit": None} otherwise (a wheel: its version says what it is)."""
    root = root if root is not None else _source_root()
    if not (root / ".git").exists():
        return {"commit": None}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": head or None, "dirty": bool(status.strip())}


def command_line(secrets: Iterable[str] = ()) -> list[str]:
    """sys.argv as given, with any stretch that holds one of `secrets` (the API keys) cut out."""
    from draftgen.core.secrets import MIN_NEEDLE, Redactor
    keys = [s for s in secrets if len(s) >= MIN_NEEDLE]
    argv = [str(a) for a in sys.argv]
    if not keys:
        return argv
    cut = Redactor(*keys)
    return [cut(a) for a in argv]


def config_secrets(config: Any) -> list[str]:
    """The keys the config names that are set in the environment (never written: only cut out)."""
    api = getattr(config, "api", None)
    names = [getattr(api, "api_key_env", ""), getattr(api, "management_key_env", "")]
    return [os.environ.get(n, "") for n in names if n]


def prompt_files(config: Any) -> list[dict[str, Any]]:
    """Each dataset's prompt file: its path as configured and the sha256 of its bytes (null: unreadable)."""
    return [{"dataset": ds.name, "path": str(ds.prompts), "sha256": file_sha256(Path(ds.prompts))}
            for ds in getattr(config, "datasets", ())]


def model_config_digest(model: tuple[dict[str, Any], str] | None) -> dict[str, Any]:
    """{"config", "config_sha256"} of a model's config as read (model_info.read_model_config's dict and source):
    the sha256 of config.json's bytes when it came from a file, of the dict as sorted JSON otherwise."""
    if model is None:
        return {}
    cfg, source = model
    digest = file_sha256(Path(source)) if Path(source).is_file() else None
    return {"config": source, "config_sha256": digest if digest is not None else json_sha256(cfg)}


def record(config: Any, started: float, *, inputs: dict[str, Any] | None = None,
           **details: Any) -> dict[str, Any]:
    """One command's record (see the top); `started` is its time.time() at the start, the end is now."""
    path = getattr(config, "path", None)
    return {
        "command": command_line(config_secrets(config)),
        "draftgen": {"version": __version__, **git_commit()},
        "versions": versions(),
        "config": {"path": str(path) if path is not None else None,
                   "sha256": file_sha256(Path(path)) if path is not None else None},
        "inputs": {"prompt_files": prompt_files(config), **(inputs or {})},
        **details,
        "host": socket.gethostname(),
        "started_at": utc(started),
        "ended_at": utc(time.time()),
    }


def read(folder: Path) -> dict[str, Any]:
    """The records of `folder`'s provenance.json ({} when there is none or it is unreadable)."""
    try:
        obj = orjson.loads((Path(folder) / PROVENANCE_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    records = obj.get("records") if isinstance(obj, dict) else None
    return records if isinstance(records, dict) else {}


def lock_path(folder: Path) -> Path:
    """The lock file of `folder`'s provenance.json: in its parent (the run directory), named after it."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    path = lock_path(folder)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as e:
        raise disk_error(path, e) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for one read and one replace: a few milliseconds
        yield
    finally:
        os.close(fd)


def add(folder: Path, name: str, rec: dict[str, Any]) -> Path:
    """Put `rec` under `name` in `folder`'s provenance.json, keeping the other commands' records."""
    folder = Path(folder)
    with _locked(folder):
        records = read(folder)
        records[name] = rec
        path = folder / PROVENANCE_FILE
        write_json_atomic(path, {"version": 1, "records": records})
    return path


def write_new(folder: Path, name: str, rec: dict[str, Any]) -> Path:
    """A fresh provenance.json in a folder being built (merged.tmp-*): `rec` its one record."""
    path = Path(folder) / PROVENANCE_FILE
    write_json_atomic(path, {"version": 1, "records": {name: rec}})
    return path
