"""Merge: every dataset's clean samples into one deduplicated, shuffled training set.

Output, in `<run>/merged/` (built in `merged.tmp-<pid>/` beside it and renamed into place):

    train.jsonl   one sample a line, SpecForge's conversation schema:
                  {"id": "<dataset>/<prompt id>",
                   "conversations": [{"role": "system", "content": str}?,    (when the prompt had one)
                                     {"role": "user", "content": str},
                                     ... earlier turns of a multi-turn prompt, as sent ...,
                                     {"role": "assistant", "content": str, "reasoning_content": str}]}
    tokens/       core/tokens/store.py format; entry k is line k of train.jsonl (same id), its
                  input_ids and loss_mask copied byte for byte from the dataset's token store
    stats.json    kept and dropped (by reason) per dataset, tokens, cost, seed, input fingerprints

What SpecForge (sgl-project/SpecForge) does with train.jsonl, read from its code:
- docs/basic_usage/data_preparation.md documents `{"id": str, "conversations": [{"role", "content"}]}`
  and says several datasets merge by concatenating JSONL files;
- data/utils.py `safe_conversations_generator` loads each line with json, keeps every key of every
  message and turns list/dict values (tool_calls) into JSON strings so Arrow sees one type;
- data/parse.py `Parser._normalize_message` accepts role/content or from/value and uses
  `content or ""`; `GeneralParser.parse` takes a first `system` message from the data (else the
  template's default system prompt), drops messages before the first user turn, and cuts the
  conversation where an assistant turn follows neither user nor tool;
- `_sanitize_message` keeps only role, content and tool_calls; `ThinkingParser` (parser_type
  "thinking", e.g. the kimi-k2-thinking and qwen3-thinking templates) also keeps
  `reasoning_content` and hands it to the tokenizer's chat template, which renders it inside
  <think>...</think>. Other parsers drop it, so it must sit beside `content`, never inside it.
So every turn gets a string `content`, the answer's reasoning goes in `reasoning_content` on the
final assistant turn, and prompt turns keep their order (system first when the prompt had one).
Arrow needs one key set per batch of rows (checked with `datasets` 3.6, 4.0, 4.4 and 5.2 through
that generator: before 5.x a `tool_calls` key present in some batches and not others fails to
load), so when any kept sample has tool calls (in its prompt or its answer), every final assistant
turn carries `tool_calls`: the answer's own (reconstruction renders them into the tokens), else
`[]` (chat templates test it for truth). Other message keys (tool_call_id, name) are left out:
SpecForge's parsers drop them.
The token ids in tokens/ are the ground truth for extraction: SpecForge re-tokenizing train.jsonl
with its own template may differ from them (e.g. it adds a default system prompt).

Safe while generation runs: each input file's size is recorded first and only complete lines up to
it are read; file handles stay open from the scan to the copy, so a file replaced meanwhile is
still read as it was. Token ids are copied with pread (raw uint32/uint8, never re-tokenized). A lock file (`merged.lock`) keeps two merges from racing.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.rundir import RunDir, disk_error
from draftgen.core.live.snapshot import StageProgress
from draftgen.core.merge.policy import NOTES, SamplePolicy
from draftgen.core.tokens.store import IDS_FILE, INDEX_FILE, MASK_FILE, TokenWriter

# Each dropped sample is counted under the first reason that applies, in this order ("failed" are
# failures.jsonl lines; "bad_line" a responses.jsonl line that is not a JSON object with an id).
# The token-level causes (provider_excluded, invalid, count_mismatch, prompt_mismatch) are the sample
# policy's, core/merge/policy.py: a structural failure drops a sample, a BPE split keeps it.
DROP_REASONS = ("failed", "truncated", "empty", "not_reconstructed", "provider_excluded", "invalid",
                "count_mismatch", "prompt_mismatch", "duplicate", "bad_line")

TRAIN_FILE, TOKENS_DIR, STATS_FILE = "train.jsonl", "tokens", "stats.json"
LOCK_FILE, TMP_PREFIX, OLD_PREFIX = "merged.lock", "merged.tmp-", "merged.old-"
FINGERPRINT_BLOCK = 64 * 1024
PROGRESS_INTERVAL_S = 0.25

ProgressCallback = Callable[[StageProgress], None]


@dataclass
class DatasetMergeStats:
    name: str
    read: int = 0                       # lines read: responses.jsonl + failures.jsonl (= kept + dropped)
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    invalid_checks: dict[str, int] = field(default_factory=dict)  # failed check -> samples dropped as invalid
    tokens: int = 0                     # input_ids of kept samples
    masked_tokens: int = 0              # loss_mask == 1 of kept samples
    cost_usd: float = 0.0               # usage.cost of kept samples
    cost_all_usd: float = 0.0           # usage.cost of every answer read (what the dataset cost)
    kept_noted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOTES, 0))  # kept, but differed

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


@dataclass(frozen=True)
class InputFingerprint:
    path: str                 # relative to the run directory
    size: int                 # bytes read (the size when the merge started)
    mtime_ns: int
    head_tail_sha256: str     # sha256 of the first and last 64 KiB of what was read


@dataclass
class MergeStats:
    seed: int
    datasets: list[DatasetMergeStats]
    inputs: list[InputFingerprint]
    policy: dict[str, Any] = field(default_factory=dict)
    system_turn: str | None = None
    samples: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    cost_usd: float = 0.0
    train_bytes: int = 0
    output_dir: str = ""
    created_at: float = 0.0
    elapsed_s: float = 0.0

    @property
    def read(self) -> int:
        return sum(d.read for d in self.datasets)

    @property
    def dropped(self) -> dict[str, int]:
        return {r: sum(d.dropped[r] for d in self.datasets) for r in DROP_REASONS}

    def to_json_dict(self) -> dict[str, Any]:
        """stats.json; everything but created_at and elapsed_s is the same for the same inputs and seed."""
        return {
            "version": 1,
            "seed": self.seed,
            "samples": self.samples,
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "cost_usd": self.cost_usd,
            "read": self.read,
            "dropped": self.dropped,
            "drop_reasons": list(DROP_REASONS),
            "kept_noted": {n: sum(d.kept_noted.get(n, 0) for d in self.datasets) for n in NOTES},
            "policy": self.policy,
            "system_turn": self.system_turn,
            "datasets": [{**asdict(d), "dropped_total": d.dropped_total} for d in self.datasets],
            "inputs": [asdict(f) for f in self.inputs],
            "outputs": {"train_jsonl": {"lines": self.samples, "bytes": self.train_bytes},
                        "tokens": {"samples": self.samples, "tokens": self.tokens}},
            "created_at": self.created_at,
            "elapsed_s": self.elapsed_s,
        }


# ---------------------------------------------------------------------------------------------
# Reading what is on disk now


def _complete_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes]]:
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
class _TokenRef:
    offset: int
    length: int
    valid: bool
    failed_checks: tuple[str, ...]
    truncated: bool
    count_diff: int | None = None
    billed: int | None = None
    prompt_diff: int | None = None


class _DatasetInput:
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

    def read_token_index(self) -> dict[str, _TokenRef]:
        refs: dict[str, _TokenRef] = {}
        if self.index is None:
            return refs
        total = 0
        for _, line in _complete_lines(self.index, self.size(self.index)):
            try:
                obj = orjson.loads(line)
                ref = _TokenRef(int(obj["offset"]), int(obj["length"]), obj.get("valid") is True,
                                tuple(obj.get("failed_checks") or ()), bool(obj.get("truncated")),
                                _int_or_none(obj.get("count_diff")), _int_or_none(obj.get("billed_tokens")),
                                _int_or_none(obj.get("prompt_diff")))
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


# ---------------------------------------------------------------------------------------------
# Classification and the SpecForge record


def prompt_key(messages: Any) -> bytes:
    """Dedupe key: a hash of everything sent (the prompt messages) in canonical JSON."""
    return hashlib.blake2b(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


def _text(content: Any) -> str:
    """A message's content as one string (OpenAI content parts joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _turn(message: dict[str, Any]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": str(message.get("role", "")), "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]  # SpecForge keeps tool_calls on a turn
    return turn


def specforge_record(sample_id: str, response: dict[str, Any], *, tool_calls_key: bool = False,
                     system: str | None = None) -> dict[str, Any]:
    """One train.jsonl object from a responses.jsonl record: the prompt as sent, then the answer.

    `tool_calls_key`: some sample of the merge has tool calls, so every row carries the key (see top).
    `system`: the default system turn the run rendered ([tokenizer] default_system): written out in
    front of a prompt without one, so no downstream template adds its own (SpecForge's kimi templates
    would add "You are a helpful assistant.").
    """
    conversations = [_turn(m) for m in response.get("messages") or () if isinstance(m, dict)]
    if system is not None and not (conversations and conversations[0]["role"] == "system"):
        conversations.insert(0, {"role": "system", "content": system})
    answer: dict[str, Any] = {"role": "assistant", "content": _text(response.get("content")),
                              "reasoning_content": _text(response.get("reasoning"))}
    if tool_calls_key or response.get("tool_calls"):
        answer["tool_calls"] = response.get("tool_calls") or []
    conversations.append(answer)
    return {"id": sample_id, "conversations": conversations}


def has_tool_calls(record: dict[str, Any]) -> bool:
    """The answer or a prompt turn has tool calls."""
    messages = record.get("messages")
    return bool(record.get("tool_calls")) or (
        isinstance(messages, list) and any(isinstance(m, dict) and m.get("tool_calls") for m in messages))


def _cost(record: dict[str, Any]) -> float:
    usage = record.get("usage")
    cost = usage.get("cost") if isinstance(usage, dict) else None
    return float(cost) if isinstance(cost, (int, float)) and math.isfinite(cost) else 0.0


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _drop_reason(record: dict[str, Any], ref: _TokenRef | None,
                 policy: SamplePolicy) -> tuple[str | None, tuple[str, ...]]:
    """(the reason a sample is dropped or None, what a kept one differed in)."""
    if record.get("truncated") or record.get("finish_reason") == "length" or (ref is not None and ref.truncated):
        return "truncated", ()
    if record.get("empty_content") or not _text(record.get("content")):
        return "empty", ()
    if ref is None:
        return "not_reconstructed", ()
    if not ref.valid and not ref.failed_checks:  # an index entry that never says it was validated
        return "invalid", ()
    verdict = policy.judge(ref.failed_checks, ref.count_diff, ref.billed, ref.prompt_diff, record.get("provider"))
    return (None, verdict.notes) if verdict.keep else (verdict.cause, ())


# ---------------------------------------------------------------------------------------------
# Progress


class _Reporter:
    """Sends StageProgress to the callback at most every PROGRESS_INTERVAL_S (and always when told)."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self.callback = callback
        self.started = time.monotonic()
        self._last = 0.0
        self.read = self.kept = self.dropped = self.written = 0
        self._phase_started = self.started

    def phase(self) -> None:
        self._phase_started = time.monotonic()

    def detail(self) -> tuple[tuple[str, str], ...]:
        return (("read", str(self.read)), ("kept", str(self.kept)), ("dropped", str(self.dropped)),
                ("written", str(self.written)))

    def send(self, state: str, done: int, total: int, message: str, *, unit: str = "/s",
             scale: float = 1.0, force: bool = False) -> None:
        now = time.monotonic()
        if self.callback is None or (not force and now - self._last < PROGRESS_INTERVAL_S):
            return
        self._last = now
        spent = max(now - self._phase_started, 1e-9)
        rate = done / spent
        eta = (total - done) / rate if rate > 0 and state == "running" else None
        self.callback(StageProgress(name="merge", state=state, done=done, total=total, rate=rate / scale,
                                    rate_unit=unit, eta_s=eta, detail=self.detail(), message=message))


# ---------------------------------------------------------------------------------------------
# Crash safety: lock, recovery, atomic switch


@contextmanager
def _merge_lock(root: Path) -> Iterator[None]:
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DraftgenError(f"{root}: another merge is running on this run directory "
                                f"(it holds {path}); wait for it to finish") from None
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


def _fsync_tree(folder: Path) -> None:
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


def _switch(tmp: Path, merged: Path) -> None:
    """merged → merged.old-<ns>, tmp → merged, then drop the old one; `recover` handles a crash between."""
    old = None
    if merged.exists():
        old = merged.with_name(f"{OLD_PREFIX}{time.time_ns()}")
        os.rename(merged, old)
    os.rename(tmp, merged)
    _fsync_dir(merged.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The merge


def merge(config: Config, progress: ProgressCallback | None = None) -> MergeStats:
    """Merge every dataset's clean samples into `<run>/merged/` (synchronous; run it in a thread).

    Pass 1 streams each responses.jsonl and keeps only (dataset, byte offset, token span) per clean,
    first-seen sample; the list is shuffled with `config.merge.seed`; pass 2 writes in that order.
    Memory grows with the number of samples, never with the length of their text.
    """
    root = Path(config.run_dir)
    if not root.is_dir():
        raise DraftgenError(f"{root}: run directory not found (output.dir in {config.path}); "
                            f"generate first with `draftgen run {config.path}`")
    reporter = _Reporter(progress)
    reporter.send("running", 0, 0, "starting", force=True)
    try:
        with _merge_lock(root):
            recover(root)
            tmp = root / f"{TMP_PREFIX}{os.getpid()}"
            try:
                stats = _merge_into(config, root, tmp, reporter)
                _switch(tmp, root / "merged")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                recover(root)  # an error between the two renames: put the old merged/ back now
                raise
    except BaseException as e:
        reporter.send("failed", reporter.written, reporter.kept, f"merge failed: {e}", force=True)
        raise
    reporter.send("done", stats.samples, stats.samples,
                  f"{stats.samples} samples, {stats.tokens} tokens → {root / 'merged'}", force=True)
    return stats


def _merge_into(config: Config, root: Path, tmp: Path, reporter: _Reporter) -> MergeStats:
    started = time.monotonic()
    inputs = [_DatasetInput(root, ds.name) for ds in config.datasets]
    try:
        per_ds = [DatasetMergeStats(ds.name) for ds in config.datasets]
        fingerprints = [fp for inp in inputs for fp in inp.fingerprints(root)]
        policy = SamplePolicy.from_config(config)
        kept, tool_calls_key = _scan(inputs, per_ds, reporter, policy)
        random.Random(config.merge.seed).shuffle(kept)
        stats = MergeStats(seed=config.merge.seed, datasets=per_ds, inputs=fingerprints, policy=policy.to_dict(),
                           system_turn=config.tokenizer.system_turn())
        tmp.mkdir()
        try:
            _write(inputs, kept, tmp, stats, reporter, tool_calls_key)
            stats.created_at = time.time()
            stats.elapsed_s = round(time.monotonic() - started, 3)
            stats.output_dir = str(root / "merged")
            (tmp / STATS_FILE).write_bytes(orjson.dumps(stats.to_json_dict(), option=orjson.OPT_INDENT_2) + b"\n")
            _fsync_tree(tmp)
        except OSError as e:
            raise disk_error(tmp, e) from e
        return stats
    finally:
        for inp in inputs:
            inp.close()


# One kept sample: (dataset index, responses.jsonl offset and line length, token offset, token length).
_Kept = tuple[int, int, int, int, int]


def _scan(inputs: list[_DatasetInput], per_ds: list[DatasetMergeStats],
          reporter: _Reporter, policy: SamplePolicy) -> tuple[list[_Kept], bool]:
    """Pass 1: classify every answer, keep the clean first-seen ones as small tuples.

    Also says whether any kept prompt has tool calls (then every row gets the key, see top).
    """
    tools = False
    total_bytes = sum(inp.size(inp.responses) for inp in inputs)
    done_bytes = 0
    seen: set[bytes] = set()
    kept: list[_Kept] = []
    reporter.phase()
    for ds_index, (inp, st) in enumerate(zip(inputs, per_ds)):
        if inp.failures is not None:
            failed = sum(1 for _ in _complete_lines(inp.failures, inp.size(inp.failures)))
            st.dropped["failed"] += failed
            st.read += failed
            reporter.read += failed
            reporter.dropped += failed
        if inp.responses is None:
            continue
        refs = inp.read_token_index()
        kept_ids: set[str] = set()  # ids are unique per dataset by contract; a repeat must not give two rows one id
        for offset, line in _complete_lines(inp.responses, inp.size(inp.responses)):
            st.read += 1
            reporter.read += 1
            reason, ref, key, sample_tools = _classify(line, refs, seen, kept_ids, st, policy)
            if reason is None:
                tools = tools or sample_tools
                seen.add(key)
                kept.append((ds_index, offset, len(line), ref.offset, ref.length))
                st.kept += 1
                reporter.kept += 1
            else:
                st.dropped[reason] += 1
                reporter.dropped += 1
            if st.read & 255 == 0:
                reporter.send("running", done_bytes + offset, total_bytes, f"reading {inp.name}",
                              unit="MB/s", scale=1e6)
        done_bytes += inp.size(inp.responses)
        del refs, kept_ids  # one dataset's token index in memory at a time
    reporter.send("running", total_bytes, total_bytes, "read", unit="MB/s", scale=1e6, force=True)
    return kept, tools


def _classify(line: bytes, refs: dict[str, _TokenRef], seen: set[bytes], kept_ids: set[str],
              st: DatasetMergeStats, policy: SamplePolicy) -> tuple[str | None, Any, bytes, bool]:
    try:
        record = orjson.loads(line)
        sample_id = str(record["id"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "bad_line", None, b"", False
    if not isinstance(record, dict):
        return "bad_line", None, b"", False
    st.cost_all_usd += _cost(record)
    ref = refs.get(sample_id)
    reason, notes = _drop_reason(record, ref, policy)
    if reason == "invalid":
        for check in ref.failed_checks or ("unvalidated",):
            st.invalid_checks[check] = st.invalid_checks.get(check, 0) + 1
    if reason is not None:
        return reason, ref, b"", False
    messages = record.get("messages")
    key = prompt_key(messages)
    if key in seen or sample_id in kept_ids:
        return "duplicate", ref, key, False
    kept_ids.add(sample_id)
    st.cost_usd += _cost(record)
    for note in notes:
        st.kept_noted[note] = st.kept_noted.get(note, 0) + 1
    return None, ref, key, has_tool_calls(record)


def _write(inputs: list[_DatasetInput], kept: list[_Kept], tmp: Path, stats: MergeStats,
           reporter: _Reporter, tool_calls_key: bool) -> None:
    """Pass 2: train.jsonl and tokens/ in shuffled order, line k ↔ token entry k."""
    reporter.phase()
    total = len(kept)
    train_bytes = 0
    with open(tmp / TRAIN_FILE, "wb", buffering=1 << 20) as train, TokenWriter(tmp / TOKENS_DIR) as tokens:
        for k, (ds_index, offset, line_length, tok_offset, tok_length) in enumerate(kept):
            inp, st = inputs[ds_index], stats.datasets[ds_index]
            record = orjson.loads(os.pread(inp.responses.fileno(), line_length, offset))
            sample_id = f"{inp.name}/{record['id']}"
            line = orjson.dumps(specforge_record(sample_id, record, tool_calls_key=tool_calls_key,
                                                 system=stats.system_turn)) + b"\n"
            train.write(line)
            train_bytes += len(line)
            ids, mask = inp.token_arrays(tok_offset, tok_length)
            tokens.append(sample_id, ids, mask, {"dataset": inp.name})
            masked = int(np.count_nonzero(mask))
            st.tokens += tok_length
            st.masked_tokens += masked
            reporter.written = k + 1
            if k & 127 == 0:
                reporter.send("running", k + 1, total, "writing")
    stats.samples = total
    stats.tokens = sum(d.tokens for d in stats.datasets)
    stats.masked_tokens = sum(d.masked_tokens for d in stats.datasets)
    stats.cost_usd = round(math.fsum(d.cost_usd for d in stats.datasets), 9)
    stats.train_bytes = train_bytes
    for d in stats.datasets:
        d.cost_usd = round(d.cost_usd, 9)
        d.cost_all_usd = round(d.cost_all_usd, 9)
    reporter.send("running", total, total, "finishing", force=True)


# ---------------------------------------------------------------------------------------------
# `draftgen merge CONFIG`


def merge_command(config: Config) -> int:
    """Headless merge: a progress line about once a second, then a summary table. Returns 0."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    last = [0.0]

    def show(p: StageProgress) -> None:
        now = time.monotonic()
        if p.state == "running" and now - last[0] < 1.0:
            return
        last[0] = now
        counts = "  ".join(f"{k} {int(v):,}" for k, v in p.detail)
        pct = f"{100 * p.done / p.total:5.1f}%" if p.total else "     "
        print(f"merge {p.state:8} {pct}  {p.message:<24}  {counts}", flush=True)

    stats = merge(config, show)
    totals = DatasetMergeStats("total", stats.read, stats.samples, stats.dropped, {}, stats.tokens,
                               stats.masked_tokens, stats.cost_usd)
    rows = [*stats.datasets, totals]
    # Names and paths are the user's text, not rich markup ("B[/x]" must print, not raise).
    table = Table(title=f"merged → {escape(stats.output_dir)} (seed {stats.seed})")
    for col in ("dataset", "read", "kept", "dropped", "tokens", "masked", "cost $"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for d in rows:
        table.add_row(escape(d.name), f"{d.read:,}", f"{d.kept:,}", f"{d.dropped_total:,}", f"{d.tokens:,}",
                      f"{d.masked_tokens:,}", f"{d.cost_usd:.4f}", end_section=d is stats.datasets[-1])
    console.print(table)
    reasons = [r for r in DROP_REASONS if totals.dropped[r]]
    if reasons:
        drops = Table(title="dropped by reason")
        drops.add_column("dataset")
        for r in reasons:
            drops.add_column(r, justify="right")
        for d in rows:
            drops.add_row(escape(d.name), *(f"{d.dropped[r]:,}" for r in reasons), end_section=d is stats.datasets[-1])
        console.print(drops)
    checks: dict[str, int] = {}
    for d in stats.datasets:
        for check, n in d.invalid_checks.items():
            checks[check] = checks.get(check, 0) + n
    if checks:
        console.print("invalid by check: " + ", ".join(f"{c} {n:,}" for c, n in sorted(checks.items())))
    noted = {n: sum(d.kept_noted.get(n, 0) for d in stats.datasets) for n in NOTES}
    if any(noted.values()):
        console.print("kept although they differed: " + ", ".join(f"{n} {c:,}" for n, c in noted.items() if c)
                      + " (see [validation] in the README)", highlight=False)
    console.print(f"{stats.samples:,} samples written in {stats.elapsed_s:.1f} s", highlight=False)
    sys.stdout.flush()
    return 0
