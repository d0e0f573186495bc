"""Append-only storage of token sequences: `<dataset>/tokens/` and `merged/tokens/`.

On-disk format (readable with numpy alone):

    tokens/
      input_ids.bin   little-endian uint32 token ids, every sample concatenated
      loss_mask.bin   uint8 0/1, one byte per token, same layout as input_ids.bin
      index.jsonl     one JSON object per sample, in write order:
                      {"id": str, "offset": int, "length": int, ...metadata}

Sample k is `input_ids.bin[offset : offset + length]` (in tokens, not bytes). Reading one with
numpy: `np.memmap(dir / "input_ids.bin", dtype="<u4")[offset:offset + length]`.

Crash safety: the two .bin files are written and flushed before the index line; an index line is
the commit. A batch (`append_encoded`: a live run's or `draftgen tokens`' batch of answers as a token
worker sends it back; `append_batch`) writes all its samples' ids, then all their masks, then all
their index lines, one write each: a crash commits the samples whose index lines are whole. On
reopening, a torn last index line is cut off and the .bin files are truncated to the end of the last
committed sample, so a crash never leaves a sample half-visible.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from draftgen.core.files import disk_error

IDS_FILE, MASK_FILE, INDEX_FILE = "input_ids.bin", "loss_mask.bin", "index.jsonl"


@dataclass(frozen=True)
class TokenEntry:
    id: str
    offset: int
    length: int
    meta: dict[str, Any]


def _read_index(path: Path) -> tuple[list[TokenEntry], int]:
    """Committed entries and the byte length of the index up to the last complete line."""
    entries: list[TokenEntry] = []
    good = 0
    if not path.exists():
        return entries, 0
    with open(path, "rb") as f:
        pos = 0
        for line in f:
            end = pos + len(line)
            if not line.endswith(b"\n"):
                break
            try:
                obj = orjson.loads(line)
                entry = TokenEntry(str(obj.pop("id")), int(obj.pop("offset")), int(obj.pop("length")), obj)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                break
            entries.append(entry)
            good = pos = end
    return entries, good


def meta_json(meta: Mapping[str, Any]) -> bytes:
    """An index line's metadata as the JSON text that follows its "length": `,"key":value...}`, or `}`
    when empty (the line is `{"id":...,"offset":...,"length":...` then this, as `append` writes it)."""
    text = orjson.dumps(meta)
    return b"," + text[1:] if len(text) > 2 else b"}"


def _write_all(f: Any, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, "no bytes written")
        view = view[n:]


class TokenWriter:
    """Appends samples; reopening an existing folder resumes after its last committed sample.
    A write that fails (full disk, file-size limit) raises DiskError naming the file and leaves the
    folder as it was before that sample.

    `buffered`: for a folder written whole and thrown away on any error (the merge's temporary
    output): writes go through 1 MB buffers instead of three system calls per sample, so a failed
    write leaves the folder in no defined state, and nothing is on disk before close()."""

    def __init__(self, folder: Path, *, fsync: bool = False, buffered: bool = False) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        entries, good = _read_index(self.folder / INDEX_FILE)
        self.ids = {e.id for e in entries}
        self.tokens = max((e.offset + e.length for e in entries), default=0)
        self.repaired = False
        index_path = self.folder / INDEX_FILE
        if index_path.exists() and index_path.stat().st_size != good:
            os.truncate(index_path, good)
            self.repaired = True
        for name, width in ((IDS_FILE, 4), (MASK_FILE, 1)):
            p = self.folder / name
            if p.exists() and p.stat().st_size != self.tokens * width:
                os.truncate(p, self.tokens * width)
                self.repaired = True
        # Unbuffered: after a failed write nothing is left in a buffer to land later, out of place.
        buffering = 1 << 20 if buffered else 0
        self._paths = (self.folder / IDS_FILE, self.folder / MASK_FILE, index_path)
        self._ids_f = open(self._paths[0], "ab", buffering=buffering)
        self._mask_f = open(self._paths[1], "ab", buffering=buffering)
        self._index_f = open(index_path, "ab", buffering=buffering)
        self._index_size = good

    def append(self, sample_id: str, input_ids: Any, loss_mask: Any, meta: dict[str, Any] | None = None) -> TokenEntry:
        ids = np.asarray(input_ids, dtype="<u4")
        mask = np.asarray(loss_mask, dtype=np.uint8)
        if ids.shape != mask.shape or ids.ndim != 1:
            raise ValueError(f"{sample_id}: input_ids {ids.shape} and loss_mask {mask.shape} differ")
        entry = TokenEntry(str(sample_id), self.tokens, int(ids.shape[0]), dict(meta or {}))
        line = orjson.dumps({"id": entry.id, "offset": entry.offset, "length": entry.length, **entry.meta}) + b"\n"
        self._write(ids.tobytes(), mask.tobytes(), line)
        self.ids.add(entry.id)
        return entry

    def append_batch(self, input_ids: bytes, loss_mask: bytes,
                     samples: Sequence[tuple[str, int, dict[str, Any]]]) -> None:
        """Append consecutive samples in one write per file: `input_ids` (little-endian uint32) and
        `loss_mask` (uint8) are theirs concatenated in the order of `samples`, each `(id, length in
        tokens, metadata)`. The files end as the same `append`s one by one leave them, and as safe: the
        index lines go last, so a crash commits a prefix of the batch; a write that fails leaves the
        folder as it was before the batch (DiskError)."""
        self.append_encoded(input_ids, loss_mask, [(sid, length, meta_json(meta)) for sid, length, meta in samples])

    def append_encoded(self, input_ids: bytes, loss_mask: bytes, samples: Sequence[tuple[str, int, bytes]]) -> None:
        """`append_batch` with each sample's metadata already encoded by `meta_json` (as a token worker
        sends it back): its index line is written without decoding or encoding the metadata again."""
        lines, names, offset = [], [], self.tokens
        for sample_id, length, meta in samples:  # one pass an answer (a live run writes every answer here)
            name = str(sample_id)
            names.append(name)
            lines.append(b'{"id":%b,"offset":%d,"length":%d%b' % (orjson.dumps(name), offset, length, meta))
            offset += length
        total = offset - self.tokens
        if len(input_ids) != 4 * total or len(loss_mask) != total:
            raise ValueError(f"a batch of {total} tokens with {len(input_ids)} bytes of ids and {len(loss_mask)} "
                             f"of mask")
        self._write(input_ids, loss_mask, b"\n".join(lines) + b"\n" if lines else b"")
        self.ids.update(names)

    def _write(self, ids: bytes, mask: bytes, lines: bytes) -> None:
        """Write samples' ids, then their masks, then their index lines (the commit), and count them."""
        ids_path, mask_path, index_path = self._paths
        target = ids_path
        try:
            _write_all(self._ids_f, ids)
            target = mask_path
            _write_all(self._mask_f, mask)
            if self._fsync:
                os.fsync(self._ids_f.fileno())
                os.fsync(self._mask_f.fileno())
            target = index_path
            _write_all(self._index_f, lines)
            if self._fsync:
                os.fsync(self._index_f.fileno())
        except OSError as e:
            # A full disk mid-sample: cut every file back to the last committed sample, so the next
            # append (when space is back) lands where the index says it does.
            self._rollback()
            raise disk_error(target, e) from e
        self.tokens += len(mask)
        self._index_size += len(lines)

    def _rollback(self) -> None:
        for f, size in ((self._ids_f, self.tokens * 4), (self._mask_f, self.tokens), (self._index_f, self._index_size)):
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), size)

    def close(self) -> None:
        """Close the files; a buffered writer's last bytes land here, so a full disk can fail it."""
        failed: tuple[Path, OSError] | None = None
        for f, path in zip((self._ids_f, self._mask_f, self._index_f), self._paths):
            try:
                f.close()
            except OSError as e:
                failed = failed or (path, e)
        if failed is not None:
            raise disk_error(*failed) from failed[1]

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TokenReader:
    """Random and sequential access to a tokens folder (memory-mapped; nothing loaded up front)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.entries, _ = _read_index(self.folder / INDEX_FILE)
        self._by_id = {e.id: i for i, e in enumerate(self.entries)}
        total = max((e.offset + e.length for e in self.entries), default=0)
        self._ids = self._map(IDS_FILE, "<u4", total)
        self._mask = self._map(MASK_FILE, np.uint8, total)

    def _map(self, name: str, dtype: Any, total: int) -> np.ndarray:
        path = self.folder / name
        if total == 0 or not path.exists():
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(total,))

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._by_id

    def entry(self, sample_id: str) -> TokenEntry:
        return self.entries[self._by_id[sample_id]]

    def arrays(self, entry: TokenEntry) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids as int64, loss_mask as int64) for one sample."""
        sl = slice(entry.offset, entry.offset + entry.length)
        return self._ids[sl].astype(np.int64), self._mask[sl].astype(np.int64)

    def raw(self, entry: TokenEntry) -> tuple[np.ndarray, np.ndarray]:
        """The stored uint32 ids and uint8 mask views, without copying (for merge)."""
        sl = slice(entry.offset, entry.offset + entry.length)
        return self._ids[sl], self._mask[sl]

    def __iter__(self) -> Iterator[tuple[TokenEntry, np.ndarray, np.ndarray]]:
        for e in self.entries:
            ids, mask = self.arrays(e)
            yield e, ids, mask
