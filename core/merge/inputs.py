"""Reading a run's files for a merge, safely while generation still writes them.

Each input file's size is recorded first and only complete lines up to it are read; file handles
stay open from the scan to the copy, so a file replaced meanwhile is still read as it was. Token
ids are copied with pread (raw uint32/uint8, never re-tokenized).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

from draftgen.core.errors import DraftgenError
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import IDS_FILE, INDEX_FILE, MASK_FILE

FINGERPRINT_BLOCK = 64 * 1024


@dataclass(frozen=True)
class InputFingerprint:
    path: str                 # relative to the run directory
    size: int                 # bytes read (the size when the merge started)
    mtime_ns: int
    head_tail_sha256: str     # sha256 of the first and last 64 KiB of what was read


def complete_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for each newline-terminated line ending at or before byte `limit`."""
    f.seek(0)
    pos = 0
    for line in f:
        end = pos + len(line)
        if end > limit or not line.endswith(b"\n"):
            return  # a line still being written (or past where we started): not ours
        yield pos, line
        pos = end


def _fingerprint(root: Path, path: Path, f: BinaryIO, size: int) -> InputFingerprint:
    digest = hashlib.sha256()
    f.seek(0)
    digest.update(f.read(min(size, FINGERPRINT_BLOCK)))
    if size > FINGERPRINT_BLOCK:
        f.seek(max(FINGERPRINT_BLOCK, size - FINGERPRINT_BLOCK))
        digest.update(f.read(size - max(FINGERPRINT_BLOCK, size - FINGERPRINT_BLOCK)))
    return InputFingerprint(str(path.relative_to(root)), size, os.fstat(f.fileno()).st_mtime_ns, digest.hexdigest())


@dataclass(frozen=True)
class TokenRef:
    offset: int
    length: int
    valid: bool
    failed_checks: tuple[str, ...]
    truncated: bool
    count_diff: int | None = None
    billed: int | None = None
    prompt_diff: int | None = None
    provider: str | None = None
    history: tuple[tuple[int, int], ...] = ()   # earlier assistant turns in the prompt (index `history_spans`)


def _spans(value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        return ()
    return tuple((int(s), int(e)) for s, e in value)


class DatasetInput:
    """One dataset's files, opened once: sizes recorded at open, handles kept until the copy is done."""

    def __init__(self, root: Path, name: str) -> None:
        run = RunDir(root)
        self.name = name
        self.responses_path = run.responses(name)
        self.failures_path = run.failures(name)
        self.tokens_dir = run.tokens(name)
        self._files: list[BinaryIO] = []
        self.responses = self._open(self.responses_path, buffering=1 << 20)  # long lines: few read calls
        self.failures = self._open(self.failures_path)
        self.index = self._open(self.tokens_dir / INDEX_FILE)
        self.sizes = {f: os.fstat(f.fileno()).st_size for f in self._files}
        # The .bin files are opened after the index so they hold every sample it commits.
        self.ids_file = self._open(self.tokens_dir / IDS_FILE)
        self.mask_file = self._open(self.tokens_dir / MASK_FILE)
        for f in (self.ids_file, self.mask_file):
            if f is not None:
                self.sizes[f] = os.fstat(f.fileno()).st_size

    def _open(self, path: Path, buffering: int = -1) -> BinaryIO | None:
        try:
            f = open(path, "rb", buffering=buffering)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DraftgenError(f"{path}: cannot read: {e.strerror}") from None
        self._files.append(f)
        return f

    def size(self, f: BinaryIO | None) -> int:
        return 0 if f is None else self.sizes[f]

    def read_token_index(self) -> dict[str, TokenRef]:
        refs: dict[str, TokenRef] = {}
        if self.index is None:
            return refs
        total = 0
        for _, line in complete_lines(self.index, self.size(self.index)):
            try:
                obj = orjson.loads(line)
                ref = TokenRef(int(obj["offset"]), int(obj["length"]), obj.get("valid") is True,
                                tuple(obj.get("failed_checks") or ()), bool(obj.get("truncated")),
                                _int_or_none(obj.get("count_diff")), _int_or_none(obj.get("billed_tokens")),
                                _int_or_none(obj.get("prompt_diff")),
                                obj.get("provider") if isinstance(obj.get("provider"), str) else None,
                                _spans(obj.get("history_spans")))
                refs[str(obj["id"])] = ref
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                break  # same rule as TokenReader: the index ends at its first unreadable line
            total = max(total, ref.offset + ref.length)
        for f, name, width in ((self.ids_file, IDS_FILE, 4), (self.mask_file, MASK_FILE, 1)):
            have = 0 if f is None else os.fstat(f.fileno()).st_size
            if have < total * width:
                raise DraftgenError(f"{self.tokens_dir / name}: holds {have // width} tokens but "
                                    f"{self.tokens_dir / INDEX_FILE} needs {total}; the token store is damaged "
                                    f"(rebuild it with `draftgen tokens`)")
        return refs

    def token_arrays(self, offset: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The stored uint32 ids and uint8 mask of one sample, read with pread.

        Not a memmap: mapped pages would count in the merge's RSS and grow with the data size.
        """
        assert self.ids_file is not None and self.mask_file is not None
        ids = os.pread(self.ids_file.fileno(), 4 * length, 4 * offset)
        mask = os.pread(self.mask_file.fileno(), length, offset)
        if len(ids) != 4 * length or len(mask) != length:
            raise DraftgenError(f"{self.tokens_dir}: a token file was cut short while merging "
                                f"(tokens {offset}..{offset + length}); run the merge again")
        return np.frombuffer(ids, dtype="<u4"), np.frombuffer(mask, dtype=np.uint8)

    def fingerprints(self, root: Path) -> list[InputFingerprint]:
        return [_fingerprint(root, Path(f.name), f, self.sizes[f]) for f in self._files]

    def close(self) -> None:
        for f in self._files:
            f.close()


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
