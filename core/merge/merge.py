"""Merge: every dataset's clean samples into one deduplicated, shuffled training set.

Deduplicated by prompt: the first clean sample of each core/dedupe.py `record_key` (roles and
normalised text of the prompt messages; for a turn of a `turns = "all"` conversation, of its prompt
side: system and user turns up to it, not the target's earlier answers) is kept, in config order.

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
                  (costs from the spend ledger, spend.jsonl: the figures the run's views show)
    fingerprint.json  which merge this is (core/tokens/identity.py): the seed, the inputs and a
                  digest of the samples in order; extraction copies it beside the hidden states

Hidden states belong to one merge: when `<run>/hidden_states/` holds files and the new merge is not
the one they came from (another seed, more answers), the merge refuses before it replaces merged/,
saying what differs, unless `replace_hidden_states` (`draftgen merge --replace-hidden-states`, the
TUI's `m` after its question): then the old folder is set aside as `hidden_states.merge-<id>/`
(one rename, nothing deleted) and extraction starts afresh. A merge that comes out the same keeps them.

The record's shape and why: core/merge/specforge.py. Safe while generation runs (core/merge/inputs.py),
and a crash never leaves a half-built merged/ (core/merge/swap.py). A lock file (`merged.lock`)
keeps two merges from racing.

Just over 400 lines: the selection, the writing and stats.json share the per-dataset tallies.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from draftgen.core.config import Config
from draftgen.core.dedupe import message_text, record_key
from draftgen.core.errors import DraftgenError
from draftgen.core.files import disk_error
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.progress import ProgressCallback, Throttle, every
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.merge.inputs import DatasetInput, InputFingerprint, TokenRef, complete_lines
from draftgen.core.merge.specforge import has_tool_calls, specforge_record
from draftgen.core.merge.swap import TMP_PREFIX, fsync_tree, merge_lock, recover, switch
from draftgen.core.records import Usage
from draftgen.core.rundir import RunDir
from draftgen.core.tokens import identity
from draftgen.core.tokens.fidelity import UNKNOWN, Agreement, flag_sources
from draftgen.core.tokens.policy import NOTES, SamplePolicy, source_key
from draftgen.core.tokens.store import TokenWriter
from draftgen.core.units import usd, usd_shown

# Each dropped sample is counted under the first reason that applies, in this order ("failed" are
# failures.jsonl lines; "bad_line" a responses.jsonl line that is not a JSON object with an id).
# The token-level causes (provider_excluded, invalid, count_mismatch, prompt_mismatch) are the sample
# policy's, core/tokens/policy.py: a structural failure drops a sample, a BPE split keeps it.
DROP_REASONS = ("failed", "truncated", "empty", "not_reconstructed", "provider_excluded", "invalid",
                "source_flagged", "count_mismatch", "prompt_mismatch", "duplicate", "bad_line")

TRAIN_FILE, TOKENS_DIR, STATS_FILE = "train.jsonl", "tokens", "stats.json"



@dataclass
class DatasetMergeStats:
    name: str
    read: int = 0                       # lines read: responses.jsonl + failures.jsonl (= kept + dropped)
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    invalid_checks: dict[str, int] = field(default_factory=dict)  # failed check -> samples dropped as invalid
    tokens: int = 0                     # input_ids of kept samples
    masked_tokens: int = 0              # loss_mask == 1 of kept samples
    cost_usd: float = 0.0               # the ledger's cost of the kept samples' answers
    cost_all_usd: float = 0.0           # the ledger's cost of the dataset (what the run's views show)
    kept_noted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NOTES, 0))  # kept, but differed
    flagged_sources: list[dict[str, Any]] = field(default_factory=list)  # sources judged on their own, and why

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


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
    merge_id: str = ""
    hidden_states: str = ""   # what became of hidden_states/ (kept, set aside), when it held files

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
            "merge_id": self.merge_id,
        }


# ---------------------------------------------------------------------------------------------
# Classification


def _drop_reason(record: dict[str, Any], ref: TokenRef | None,
                 policy: SamplePolicy) -> tuple[str | None, tuple[str, ...]]:
    """(the reason a sample is dropped or None, what a kept one differed in)."""
    if record.get("truncated") or record.get("finish_reason") == "length" or (ref is not None and ref.truncated):
        return "truncated", ()
    if record.get("empty_content") or not message_text(record.get("content")):
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
        self._throttle = Throttle()
        self.read = self.kept = self.dropped = self.written = 0
        self._phase_started = self.started

    def phase(self) -> None:
        self._phase_started = time.monotonic()

    def detail(self) -> tuple[tuple[str, str], ...]:
        return (("read", str(self.read)), ("kept", str(self.kept)), ("dropped", str(self.dropped)),
                ("written", str(self.written)))

    def send(self, state: StageState, done: int, total: int, message: str, *, unit: str = "/s",
             scale: float = 1.0, force: bool = False) -> None:
        if self.callback is None or not self._throttle.due(force):
            return
        now = time.monotonic()
        spent = max(now - self._phase_started, 1e-9)
        rate = done / spent
        eta = (total - done) / rate if rate > 0 and state == StageState.RUNNING else None
        self.callback(StageProgress(name="merge", state=state, done=done, total=total, rate=rate / scale,
                                    rate_unit=unit, eta_s=eta, detail=self.detail(), message=message))


# ---------------------------------------------------------------------------------------------
# The merge


def merge(config: Config, progress: ProgressCallback | None = None, *,
          replace_hidden_states: bool = False) -> MergeStats:
    """Merge every dataset's clean samples into `<run>/merged/` (synchronous; run it in a thread).

    Pass 1 streams each responses.jsonl and keeps only (dataset, byte offset, token span) per clean,
    first-seen sample; the list is shuffled with `config.merge.seed`; pass 2 writes in that order.
    Memory grows with the number of samples, never with the length of their text.
    Hidden states of another merge: refused, or set aside with `replace_hidden_states` (see the top).
    """
    root = Path(config.run_dir)
    if not root.is_dir():
        raise DraftgenError(f"{root}: run directory not found (output.dir in {config.path}); "
                            f"generate first with `draftgen run {config.path}`")
    reporter = _Reporter(progress)
    reporter.send(StageState.RUNNING, 0, 0, "starting", force=True)
    try:
        with merge_lock(root):
            recover(root)
            tmp = root / f"{TMP_PREFIX}{os.getpid()}"
            try:
                stats = _merge_into(config, root, tmp, reporter)
                stats.hidden_states = _hidden_states_guard(config, root, tmp, replace_hidden_states)
                switch(tmp, root / "merged")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                recover(root)  # an error between the two renames: put the old merged/ back now
                raise
    except BaseException as e:
        reporter.send(StageState.FAILED, reporter.written, reporter.kept, f"merge failed: {e}", force=True)
        raise
    reporter.send(StageState.DONE, stats.samples, stats.samples,
                  f"{stats.samples} samples, {stats.tokens} tokens → {root / 'merged'}", force=True)
    return stats


def _merge_into(config: Config, root: Path, tmp: Path, reporter: _Reporter) -> MergeStats:
    started = time.monotonic()
    inputs = [DatasetInput(root, ds.name) for ds in config.datasets]
    try:
        per_ds = [DatasetMergeStats(ds.name) for ds in config.datasets]
        fingerprints = [fp for inp in inputs for fp in inp.fingerprints(root)]
        policy = SamplePolicy.from_config(config)
        # Read only (a run may be writing it); a directory without one (before the ledger) has usage.cost alone.
        spend = RunDir(root).spend
        ledger = SpendLedger.read(spend, answer_costs=True) if spend.exists() else None
        kept, tool_calls_key = _scan(inputs, per_ds, reporter, policy, ledger)
        random.Random(config.merge.seed).shuffle(kept)
        stats = MergeStats(seed=config.merge.seed, datasets=per_ds, inputs=fingerprints, policy=policy.to_dict(),
                           system_turn=config.tokenizer.system_turn())
        tmp.mkdir()
        try:
            _write(inputs, kept, tmp, stats, reporter, tool_calls_key)
            stats.created_at = time.time()
            stats.elapsed_s = round(time.monotonic() - started, 3)
            stats.output_dir = str(root / "merged")
            digest, tokens = identity.folder_digest(tmp / TOKENS_DIR)
            fp = identity.MergeFingerprint(samples_sha256=digest, samples=stats.samples, tokens=tokens,
                                           seed=config.merge.seed, created_at=stats.created_at, inputs=tuple(
                                               {"path": f.path, "size": f.size, "sha256": f.head_tail_sha256}
                                               for f in fingerprints))
            stats.merge_id = fp.merge_id
            identity.write_fingerprint(tmp / identity.FINGERPRINT_FILE, fp)
            (tmp / STATS_FILE).write_bytes(orjson.dumps(stats.to_json_dict(), option=orjson.OPT_INDENT_2) + b"\n")
            fsync_tree(tmp)
        except OSError as e:
            raise disk_error(tmp, e) from e
        return stats
    finally:
        for inp in inputs:
            inp.close()


def _hidden_states_guard(config: Config, root: Path, tmp: Path, replace: bool) -> str:
    """Before merged/ is replaced: refuse to leave hidden_states/ holding files of another merge, or (with
    `replace`) set it aside. Returns what became of it ('' when it holds no file)."""
    hidden = RunDir(root).hidden_states
    files = identity.stored_samples(hidden)
    if not files:
        return ""
    new = identity.read_fingerprint(tmp / identity.FINGERPRINT_FILE)
    old = identity.read_fingerprint(hidden / identity.HIDDEN_MERGE_FILE)
    assert new is not None
    if new.same_merge(old):
        return f"hidden_states/ ({files:,} files) belongs to this merge still: kept"
    what = "; ".join(identity.differences(old, new))
    came = old.describe() if old is not None else "an unrecorded merge"
    if not replace:
        raise DraftgenError(
            f"{hidden}: holds {files:,} hidden-state files of {came}, and this merge is another "
            f"({new.describe()}: {what}). Replacing merged/ would leave them holding other samples than "
            f"merged/ at the same index, so merged/ was left as it was. To merge anyway: `draftgen merge "
            f"{config.path} --replace-hidden-states` (moves them aside to {identity.aside_path(hidden, old)}/, "
            f"nothing deleted; then `draftgen extract {config.path}` extracts the new merge)")
    try:
        dest = identity.set_aside(hidden, old)
    except OSError as e:
        raise disk_error(hidden, e) from e
    return (f"hidden_states/ ({files:,} files of {came}) set aside as {dest} ({what}); "
            f"`draftgen extract {config.path}` extracts this merge; delete the old folder when done with it")


# One kept sample: (dataset index, responses.jsonl offset and line length, token offset, token length).
_Kept = tuple[int, int, int, int, int]


def _scan(inputs: list[DatasetInput], per_ds: list[DatasetMergeStats],
          reporter: _Reporter, policy: SamplePolicy, ledger: SpendLedger | None = None) -> tuple[list[_Kept], bool]:
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
            failed = sum(1 for _ in complete_lines(inp.failures, inp.size(inp.failures)))
            st.dropped["failed"] += failed
            st.read += failed
            reporter.read += failed
            reporter.dropped += failed
        if inp.responses is None:
            continue
        refs = inp.read_token_index()
        ds_policy = _flag_sources(refs, st, policy)
        # An answer the ledger has no line for (carried or found from an older run) cost its usage.cost there too.
        costs = (ledger.answer_costs or {}).get(inp.name, {}) if ledger is not None else {}
        kept_ids: set[str] = set()  # ids are unique per dataset by contract; a repeat must not give two rows one id
        for offset, line in complete_lines(inp.responses, inp.size(inp.responses)):
            st.read += 1
            reporter.read += 1
            reason, ref, key, sample_tools = _classify(line, refs, seen, kept_ids, st, ds_policy, costs)
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
                reporter.send(StageState.RUNNING, done_bytes + offset, total_bytes, f"reading {inp.name}",
                              unit="MB/s", scale=1e6)
        done_bytes += inp.size(inp.responses)
        del refs, kept_ids  # one dataset's token index in memory at a time
    for st in per_ds:  # what the dataset cost: the ledger's figure, attempts without an answer included
        if ledger is not None and st.name in ledger.by_dataset:
            st.cost_all_usd = ledger.by_dataset[st.name]
    reporter.send(StageState.RUNNING, total_bytes, total_bytes, "read", unit="MB/s", scale=1e6, force=True)
    return kept, tools


def _flag_sources(refs: dict[str, TokenRef], st: DatasetMergeStats, policy: SamplePolicy) -> SamplePolicy:
    """The policy for one dataset: its sources (providers, or the self-hosted server) whose answer counts
    are off on their own (core/tokens/fidelity.py flag_sources) noted in `st`, and flagged in the policy."""
    per: dict[str, Agreement] = {}
    for ref in refs.values():
        if not ref.truncated and ref.count_diff is not None:
            per.setdefault(ref.provider or UNKNOWN, Agreement()).add(ref.count_diff, ref.billed, None)
    v = policy.limits
    flags = flag_sources(per, min_answers=v.provider_min_answers, min_exact_share=v.min_exact_share)
    st.flagged_sources = [{"provider": f.provider, "reason": f.reason, "fix": f.fix,
                           "dropped": v.drop_flagged_sources} for f in flags]
    if not flags:
        return policy
    return replace(policy, flagged_sources=frozenset(source_key(f.provider) for f in flags))


def _classify(line: bytes, refs: dict[str, TokenRef], seen: set[bytes], kept_ids: set[str],
              st: DatasetMergeStats, policy: SamplePolicy,
              costs: dict[str, float] | None = None) -> tuple[str | None, Any, bytes, bool]:
    try:
        record = orjson.loads(line)
        sample_id = str(record["id"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "bad_line", None, b"", False
    if not isinstance(record, dict):
        return "bad_line", None, b"", False
    st.cost_all_usd += Usage.from_dict(record.get("usage")).cost
    ref = refs.get(sample_id)
    reason, notes = _drop_reason(record, ref, policy)
    if reason == "invalid":
        for check in (ref.failed_checks if ref is not None else ()) or ("unvalidated",):
            st.invalid_checks[check] = st.invalid_checks.get(check, 0) + 1
    if reason is not None:
        return reason, ref, b"", False
    # Normalised text, a conversation turn on its prompt side: the same notion of duplicate as `prompts
    # build` and `run` (core/dedupe.py record_key).
    key = record_key(record)
    if key in seen or sample_id in kept_ids:
        return "duplicate", ref, key, False
    kept_ids.add(sample_id)
    cost = (costs or {}).get(sample_id)
    st.cost_usd += Usage.from_dict(record.get("usage")).cost if cost is None else cost
    for note in notes:
        st.kept_noted[note] = st.kept_noted.get(note, 0) + 1
    return None, ref, key, has_tool_calls(record)


def _write(inputs: list[DatasetInput], kept: list[_Kept], tmp: Path, stats: MergeStats,
           reporter: _Reporter, tool_calls_key: bool) -> None:
    """Pass 2: train.jsonl and tokens/ in shuffled order, line k ↔ token entry k."""
    reporter.phase()
    total = len(kept)
    train_bytes = 0
    # A dataset has a kept line only if its responses file opened (pass 1 read it): -1 is never read.
    responses = [inp.responses.fileno() if inp.responses is not None else -1 for inp in inputs]
    # Buffered token files: the temporary folder is thrown away on any error, so no write needs to
    # be its own commit (three system calls a sample were a tenth of the merge).
    with open(tmp / TRAIN_FILE, "wb", buffering=1 << 20) as train, \
            TokenWriter(tmp / TOKENS_DIR, buffered=True) as tokens:
        for k, (ds_index, offset, line_length, tok_offset, tok_length) in enumerate(kept):
            inp, st = inputs[ds_index], stats.datasets[ds_index]
            record = orjson.loads(os.pread(responses[ds_index], line_length, offset))
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
                reporter.send(StageState.RUNNING, k + 1, total, "writing")
    stats.samples = total
    stats.tokens = sum(d.tokens for d in stats.datasets)
    stats.masked_tokens = sum(d.masked_tokens for d in stats.datasets)
    stats.cost_usd = round(math.fsum(d.cost_usd for d in stats.datasets), 9)
    stats.train_bytes = train_bytes
    for d in stats.datasets:
        d.cost_usd = round(d.cost_usd, 9)
        d.cost_all_usd = round(d.cost_all_usd, 9)
    reporter.send(StageState.RUNNING, total, total, "finishing", force=True)


# ---------------------------------------------------------------------------------------------
# `draftgen merge CONFIG`


def merge_command(config: Config, *, replace_hidden_states: bool = False) -> int:
    """Headless merge: a progress line about once a second, then a summary table. Returns 0."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    def show(p: StageProgress) -> None:
        counts = "  ".join(f"{k} {int(v):,}" for k, v in p.detail)
        pct = f"{100 * p.done / p.total:5.1f}%" if p.total else "     "
        print(f"merge {p.state:8} {pct}  {p.message:<24}  {counts}", flush=True)

    stats = merge(config, every(1.0, show), replace_hidden_states=replace_hidden_states)
    # The total row is the sum of the rows as shown (units.usd_shown), as in the run's summary.
    totals = DatasetMergeStats("total", stats.read, stats.samples, stats.dropped, {}, stats.tokens,
                               stats.masked_tokens, sum(usd_shown(d.cost_usd) for d in stats.datasets),
                               sum(usd_shown(d.cost_all_usd) for d in stats.datasets))
    rows = [*stats.datasets, totals]
    # Names and paths are the user's text, not rich markup ("B[/x]" must print, not raise).
    table = Table(title=f"merged → {escape(stats.output_dir)} (seed {stats.seed})")
    # Costs from the spend ledger: "spent" is the dataset's figure in the run's views and report.
    for col in ("dataset", "read", "kept", "dropped", "tokens", "masked", "kept cost", "spent"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for d in rows:
        table.add_row(escape(d.name), f"{d.read:,}", f"{d.kept:,}", f"{d.dropped_total:,}", f"{d.tokens:,}",
                      f"{d.masked_tokens:,}", usd(d.cost_usd), usd(d.cost_all_usd), end_section=d is stats.datasets[-1])
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
                      + " (see \\[validation] in docs/config.md)", highlight=False)
    for d in stats.datasets:
        for f in d.flagged_sources:
            what = "dropped" if f["dropped"] else "kept ([validation] drop_flagged_sources = false)"
            console.print(f"[bold red]FLAGGED[/] {escape(d.name)} {escape(f['provider'])}: {escape(f['reason'])}; "
                          f"its samples {escape(what)}. To change: {escape(f['fix'])}", soft_wrap=True, highlight=False)
    console.print(f"{stats.samples:,} samples written in {stats.elapsed_s:.1f} s (merge {stats.merge_id})",
                  highlight=False)
    if stats.hidden_states:
        console.print(escape(stats.hidden_states), soft_wrap=True, highlight=False)
    sys.stdout.flush()
    return 0
