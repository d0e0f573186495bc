"""Which merge a tokens folder is, and so which merge a set of hidden states belongs to.

A merge writes `merged/fingerprint.json` (core/merge/merge.py); extraction copies it to
`hidden_states/merge.json` before its first file and never adds to hidden states of another merge
(core/extract/claim.py). Both files hold:

    {"version": 1,
     "merge_id": "<first 16 hex digits of samples_sha256>",
     "samples_sha256": sha256 over every sample of merged/tokens in order: its id (UTF-8, then a 0
                       byte), its length (8 bytes LE), its input_ids (uint32 LE) and loss_mask (uint8),
     "samples": int, "tokens": int,
     "seed": int | null,                       (null: merged by an older draftgen, seed unknown)
     "inputs": [{"path", "size", "sha256"}],   each dataset file the merge read: bytes read and the
                                               sha256 of their first and last 64 KiB
     "created_at": float}

Two merges are the same when `samples_sha256` is equal: every hidden-state file is then the file of
the same sample (index k holds merged/tokens entry k's ids and mask). The seed, the sample count and
the inputs only say *why* two merges differ.

SpecForge's reader walks the hidden-states folder and keeps the files ending in `.ckpt` or
`.ckpt.gz` (core/extract/layout.py); `merge.json` and the stats files are not among them.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from draftgen.core.files import write_json_atomic
from draftgen.core.tokens.store import IDS_FILE, INDEX_FILE, MASK_FILE, TokenReader

FINGERPRINT_FILE = "fingerprint.json"   # in merged/
HIDDEN_MERGE_FILE = "merge.json"        # in hidden_states/
# What SpecForge's reader picks up (core/extract/layout.py), and speculators' hs_{i}.safetensors
# (core/extract/speculators_layout.py).
SAMPLE_SUFFIXES = (".ckpt", ".ckpt.gz", ".safetensors")
ASIDE_INFIX = ".merge-"                 # hidden_states.merge-<merge id>/: hidden states set aside


@dataclass(frozen=True)
class MergeFingerprint:
    samples_sha256: str
    samples: int
    tokens: int
    seed: int | None = None
    inputs: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    created_at: float = 0.0

    @property
    def merge_id(self) -> str:
        return self.samples_sha256[:16]

    def same_merge(self, other: MergeFingerprint | None) -> bool:
        return other is not None and other.samples_sha256 == self.samples_sha256

    def describe(self) -> str:
        seed = "seed unknown" if self.seed is None else f"seed {self.seed}"
        return f"merge {self.merge_id} ({self.samples:,} samples, {self.tokens:,} tokens, {seed})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = list(self.inputs)
        return {"version": 1, "merge_id": self.merge_id, **d}


def samples_digest(reader: TokenReader) -> tuple[str, int]:
    """(samples_sha256, tokens) of a tokens folder, read in order (see the top of this module)."""
    h = hashlib.sha256()
    tokens = 0
    for entry in reader.entries:
        ids, mask = reader.raw(entry)
        h.update(entry.id.encode("utf-8") + b"\0" + entry.length.to_bytes(8, "little"))
        h.update(ids.astype("<u4", copy=False).tobytes())
        h.update(mask.tobytes())
        tokens += entry.length
    return h.hexdigest(), tokens


def _folder_key(folder: Path) -> tuple[Any, ...] | None:
    try:
        stats = [os.stat(folder / name) for name in (INDEX_FILE, IDS_FILE, MASK_FILE)]
    except OSError:
        return None
    return (str(folder.resolve()), *((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats))


def folder_digest(folder: Path) -> tuple[str, int]:
    """samples_digest of `folder`, remembered while its three files are unchanged (a merge replaces them)."""
    key = _folder_key(folder)
    if key is None:
        return samples_digest(TokenReader(folder))
    return _digest_of(key)


@functools.lru_cache(maxsize=1)  # one folder at a time is all anyone asks about
def _digest_of(key: tuple[Any, ...]) -> tuple[str, int]:
    """samples_digest of the folder `key` names (its resolved path, then its three files' inode, size and
    mtime): keyed by the content, so a folder changed since is read again."""
    return samples_digest(TokenReader(Path(key[0])))


def read_fingerprint(path: Path) -> MergeFingerprint | None:
    """The fingerprint in `path`, or None when there is none (or it is unreadable: treated as unknown)."""
    try:
        obj = orjson.loads(Path(path).read_bytes())
        return MergeFingerprint(samples_sha256=str(obj["samples_sha256"]), samples=int(obj["samples"]),
                                tokens=int(obj.get("tokens") or 0),
                                seed=obj["seed"] if isinstance(obj.get("seed"), int) else None,
                                inputs=tuple(x for x in obj.get("inputs") or () if isinstance(x, dict)),
                                created_at=float(obj.get("created_at") or 0.0))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def write_fingerprint(path: Path, fp: MergeFingerprint) -> None:
    write_json_atomic(Path(path), fp.to_dict())


def merged_fingerprint(merged: Path) -> MergeFingerprint:
    """What merged/ is, from its tokens themselves: the recorded fingerprint when its digest agrees, else
    one without seed or inputs (merged/ written by an older draftgen, or changed since)."""
    digest, tokens = folder_digest(Path(merged) / "tokens")
    recorded = read_fingerprint(Path(merged) / FINGERPRINT_FILE)
    if recorded is not None and recorded.samples_sha256 == digest:
        return recorded
    return MergeFingerprint(samples_sha256=digest, samples=len(TokenReader(Path(merged) / "tokens").entries),
                            tokens=tokens)


def differences(old: MergeFingerprint | None, new: MergeFingerprint) -> list[str]:
    """What differs between the merge hidden states came from (`old`) and `new`, in words."""
    if old is None:
        return ["no record of the merge they came from (extracted by an older draftgen)"]
    out: list[str] = []
    if old.seed != new.seed and old.seed is not None and new.seed is not None:
        out.append(f"[merge] seed {old.seed} -> {new.seed} (the samples are in another order)")
    if old.samples != new.samples:
        out.append(f"samples {old.samples:,} -> {new.samples:,}")
    if old.inputs and new.inputs:
        before = {x.get("path"): x for x in old.inputs}
        after = {x.get("path"): x for x in new.inputs}
        changed = [f"{p} {before[p].get('size', 0):,} -> {after[p].get('size', 0):,} bytes" for p in after
                   if p in before and (before[p].get("size"), before[p].get("sha256"))
                   != (after[p].get("size"), after[p].get("sha256"))]
        changed += [f"{p} new" for p in after if p not in before]
        changed += [f"{p} gone" for p in before if p not in after]
        if changed:
            shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
            out.append(f"inputs changed (more answers, or tokens rebuilt): {shown}")
    if not out:
        out.append("the samples' token ids or order differ")
    return out


def stored_samples(root: Path, *, stop_at: int | None = None) -> int:
    """How many hidden-state files SpecForge or speculators would read under `root` (at most `stop_at` counted)."""
    count = 0
    for _dir, _subdirs, files in os.walk(root):
        count += sum(1 for f in files if f.endswith(SAMPLE_SUFFIXES))
        if stop_at is not None and count >= stop_at:
            return count
    return count


def aside_path(root: Path, old: MergeFingerprint | None) -> Path:
    """A free name beside `root` for hidden states set aside: hidden_states.merge-<id>[-2, -3, ...]."""
    base = f"{root.name}{ASIDE_INFIX}{old.merge_id if old is not None else 'unknown'}"
    path = root.with_name(base)
    n = 2
    while path.exists():
        path = root.with_name(f"{base}-{n}")
        n += 1
    return path


def set_aside(root: Path, old: MergeFingerprint | None) -> Path:
    """Move `root` (hidden states of another merge) to a free name beside it; one rename, nothing lost."""
    dest = aside_path(root, old)
    os.rename(root, dest)
    return dest
