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
    train-tokens.jsonl  the same samples pre-tokenized, for online trainers: line k is
                  {"id": str, "input_ids": [int, ...], "loss_mask": [0|1, ...]}, tokens/' entry k as
                  JSON (SpecForge's `prepare_prompt_tasks` reads a file whose first record has
                  input_ids and loss_mask verbatim; re-rendering train.jsonl gives other ids)
    stats.json    kept and dropped (by reason) per dataset, tokens, cost, seed, input fingerprints
                  (costs from the spend ledger, spend.jsonl: the figures the run's views show); for
                  turns of multi-turn conversations, `by_turn` (per turn number: read, kept, dropped
                  by reason; for agent steps `diverged` and `replayed` lines, docs/multi-turn.md) and
                  `multi_turn`, the mode they were merged in
    fingerprint.json  which merge this is (core/tokens/identity.py): the seed, the inputs and a
                  digest of the samples in order; extraction copies it beside the hidden states
    provenance.json  what made it (core/provenance.py): the command line, draftgen's version and
                  commit, the libraries' versions, the config's and prompt files' digests, the merge
                  id, host, start and end times

Turns of multi-turn conversations (a turns = "all" dataset): `[merge] multi_turn` "per_turn" keeps
each turn as a sample of its own (id `<dataset>/<conversation>#t<k>`, its history + its answer, loss on
that answer); "per_conversation" one sample per conversation (id `<dataset>/<conversation>`, every
assistant turn in the loss mask). Either way a broken turn drops the rest of its conversation.
The rules: core/merge/turns.py.

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
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.files import disk_error
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.progress import ProgressCallback, Throttle, every
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.merge import contamination
from draftgen.core.merge.contamination import ContaminationFilter, Match
from draftgen.core.merge.inputs import DatasetInput, InputFingerprint, TokenRef, complete_lines
from draftgen.core.merge.specforge import has_tool_calls, specforge_record
from draftgen.core.merge.swap import TMP_PREFIX, fsync_tree, merge_lock, recover, switch
from draftgen.core.merge.turns import (
    AGENT_FLAGS,
    TURN_REASONS,
    PendingTurn,
    add_turns,
    count_turn,
    resolve,
    sorted_turns,
    turn_of,
)
from draftgen.core.quoting import sh_path
from draftgen.core.records import Usage, answer_source, same_model
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible
from draftgen.core.tokens import identity
from draftgen.core.tokens.fidelity import UNKNOWN, Agreement, flag_sources
from draftgen.core.tokens.policy import NOTES, SamplePolicy, source_key
from draftgen.core.tokens.store import TokenWriter
from draftgen.core.units import usd, usd_shown

# Each dropped sample is counted under the first reason that applies, in this order ("failed" are
# failures.jsonl lines; "bad_line" a responses.jsonl line that is not a JSON object with an id;
# "other_model" an answer whose `model` is not [api] model, core/records.py same_model).
# The token-level causes (provider_excluded, invalid, count_mismatch, prompt_mismatch) are the sample
# policy's, core/tokens/policy.py: a structural failure drops a sample, a BPE split keeps it.
# Turns of multi-turn conversations add theirs (core/merge/turns.py): after_invalid_turn (a later turn
# of a conversation whose answer broke), and with [merge] multi_turn = "per_conversation",
# after_dropped_turn and in_conversation (a turn whose answer is in its conversation's sample).
# "contaminated": a sample that would be kept whose prompt holds a benchmark's ([merge] exclude,
# core/merge/contamination.py), told before duplicates so a copy of it is dropped as contaminated too.
DROP_REASONS = ("failed", "other_model", "truncated", "empty", "not_reconstructed", "provider_excluded", "invalid",
                "source_flagged", "count_mismatch", "prompt_mismatch", "contaminated", "duplicate", "bad_line",
                *TURN_REASONS)

TRAIN_FILE, TOKENS_DIR, STATS_FILE = "train.jsonl", "tokens", "stats.json"
TRAIN_TOKENS_FILE = "train-tokens.jsonl"  # tokens/ as JSON lines: what an online trainer reads



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
    # Turn lines of multi-turn conversations by turn number: {"k": {"read", "kept", "dropped": {reason: n}}}
    by_turn: dict[str, dict[str, Any]] = field(default_factory=dict)
    contaminated: dict[str, int] = field(default_factory=dict)  # benchmark -> samples dropped as contaminated

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
    train_tokens_bytes: int = 0
    output_dir: str = ""
    created_at: float = 0.0
    elapsed_s: float = 0.0
    merge_id: str = ""
    hidden_states: str = ""   # what became of hidden_states/ (kept, set aside), when it held files
    multi_turn: str = "per_turn"  # [merge] multi_turn
    contamination: dict[str, Any] = field(default_factory=dict)  # the filter's rule, benchmarks, drops by benchmark

    @property
    def read(self) -> int:
        return sum(d.read for d in self.datasets)

    @property
    def dropped(self) -> dict[str, int]:
        return {r: sum(d.dropped[r] for d in self.datasets) for r in DROP_REASONS}

    @property
    def by_turn(self) -> dict[str, dict[str, Any]]:
        total: dict[str, dict[str, Any]] = {}
        for d in self.datasets:
            add_turns(total, d.by_turn)
        return sorted_turns(total)

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
            "multi_turn": self.multi_turn,
            "by_turn": self.by_turn,
            "contamination": self.contamination,
            "datasets": [{**asdict(d), "dropped_total": d.dropped_total} for d in self.datasets],
            "inputs": [asdict(f) for f in self.inputs],
            "outputs": {"train_jsonl": {"lines": self.samples, "bytes": self.train_bytes},
                        "train_tokens_jsonl": {"lines": self.samples, "bytes": self.train_tokens_bytes},
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
    if policy.model and not same_model(policy.model, record.get("model")):  # another model's answer, any run's
        return "other_model", ()
    if record.get("truncated") or record.get("finish_reason") == "length" or (ref is not None and ref.truncated):
        return "truncated", ()
    # An agent step that answers with tool calls only has no content: its calls are the answer.
    if not record.get("tool_calls") and (record.get("empty_content") or not message_text(record.get("content"))):
        return "empty", ()
    if ref is None:
        return "not_reconstructed", ()
    if not ref.valid and not ref.failed_checks:  # an index entry that never says it was validated
        return "invalid", ()
    verdict = policy.judge(ref.failed_checks, ref.count_diff, ref.billed, ref.prompt_diff, answer_source(record))
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
    if config.merge.multi_turn == "per_conversation" and config.tokenizer.template != "kimi-k2.5":
        raise ConfigError(f"{config.path}: merge.multi_turn = \"per_conversation\" needs tokenizer.template = "
                          f"\"kimi-k2.5\" (the template that says where each earlier assistant turn sits, to put "
                          f"it in the loss mask); with template \"{config.tokenizer.template}\" use \"per_turn\"")
    if not root.is_dir():
        raise DraftgenError(f"{root}: run directory not found (output.dir in {config.path}); "
                            f"generate first with `draftgen run {sh_path(config.path)}`")
    screen = contamination.load(config)  # every benchmark read (or a missing one said) before anything is written
    reporter = _Reporter(progress)
    reporter.send(StageState.RUNNING, 0, 0, "starting", force=True)
    try:
        with merge_lock(root):
            recover(root)
            tmp = root / f"{TMP_PREFIX}{os.getpid()}"
            try:
                stats = _merge_into(config, root, tmp, reporter, screen)
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


def _merge_into(config: Config, root: Path, tmp: Path, reporter: _Reporter,
                screen: ContaminationFilter | None = None) -> MergeStats:
    started = time.monotonic()
    started_at = time.time()
    inputs = [DatasetInput(root, ds.name) for ds in config.datasets]
    try:
        per_ds = [DatasetMergeStats(ds.name) for ds in config.datasets]
        fingerprints = [fp for inp in inputs for fp in inp.fingerprints(root)]
        policy = SamplePolicy.from_config(config)
        # Read only (a run may be writing it); a directory without one (before the ledger) has usage.cost alone.
        spend = RunDir(root).spend
        ledger = SpendLedger.read(spend, answer_costs=True) if spend.exists() else None
        matches: list[Match] = []
        kept, tool_calls_key = _scan(inputs, per_ds, reporter, policy, ledger, config.merge.multi_turn, screen, matches)
        random.Random(config.merge.seed).shuffle(kept)
        stats = MergeStats(seed=config.merge.seed, datasets=per_ds, inputs=fingerprints, policy=policy.to_dict(),
                           system_turn=config.tokenizer.system_turn(), multi_turn=config.merge.multi_turn)
        if screen is not None:
            stats.contamination = {**screen.settings(), "dropped": screen.counts(matches)}
        tmp.mkdir()
        try:
            _write(inputs, kept, tmp, stats, reporter, tool_calls_key)
            if screen is not None:
                contamination.write_report(tmp / contamination.REPORT_FILE, matches)
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
            _write_provenance(config, tmp, fp, started_at)  # inside the folder the switch puts in place
            fsync_tree(tmp)
        except OSError as e:
            raise disk_error(tmp, e) from e
        return stats
    finally:
        for inp in inputs:
            inp.close()


def _write_provenance(config: Config, tmp: Path, fp: identity.MergeFingerprint, started_at: float) -> None:
    """merged/provenance.json (core/provenance.py): the command, versions, config and inputs of this merge."""
    from draftgen.core import provenance
    provenance.write_new(tmp, "merge", provenance.record(
        config, started_at, inputs={"merge_id": fp.merge_id, "samples_sha256": fp.samples_sha256,
                                    "responses": list(fp.inputs)},
        seed=config.merge.seed, multi_turn=config.merge.multi_turn, samples=fp.samples, tokens=fp.tokens))


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
            f"merged/ at the same index, so merged/ was left as it was. To merge anyway: "
            f"`draftgen merge {sh_path(config.path)} --replace-hidden-states` (moves them aside to "
            f"{identity.aside_path(hidden, old)}/, nothing deleted; then `draftgen extract {sh_path(config.path)}` "
            f"extracts the new merge)")
    try:
        dest = identity.set_aside(hidden, old)
    except OSError as e:
        raise disk_error(hidden, e) from e
    return (f"hidden_states/ ({files:,} files of {came}) set aside as {dest} ({what}); "
            f"`draftgen extract {sh_path(config.path)}` extracts this merge; delete the old folder when done with it")


# One kept sample: (dataset index, responses.jsonl offset and line length, token offset, token length,
# the earlier assistant turns its loss mask also covers: None for a sample as stored, the spans for a
# per-conversation sample).
_Kept = tuple[int, int, int, int, int, "tuple[tuple[int, int], ...] | None"]


@dataclass
class _Seen:
    """What pass 1 has kept so far: prompt keys (across datasets) and one dataset's sample ids."""
    keys: set[bytes] = field(default_factory=set)
    # One dataset's kept ids: unique by contract; a repeat must not give two rows one id.
    ids: set[str] = field(default_factory=set)


def _scan(inputs: list[DatasetInput], per_ds: list[DatasetMergeStats], reporter: _Reporter, policy: SamplePolicy,
          ledger: SpendLedger | None = None, multi_turn: str = "per_turn", screen: ContaminationFilter | None = None,
          matches: list[Match] | None = None) -> tuple[list[_Kept], bool]:
    """Pass 1: classify every answer, keep the clean first-seen ones as small tuples.

    Also says whether any kept prompt has tool calls (then every row gets the key, see top).
    """
    tools = False
    total_bytes = sum(inp.size(inp.responses) for inp in inputs)
    done_bytes = 0
    seen = _Seen()
    kept: list[_Kept] = []
    reporter.phase()
    for ds_index, (inp, st) in enumerate(zip(inputs, per_ds)):
        if inp.failures is not None:
            failed = _count_failures(inp, st)
            reporter.read += failed
            reporter.dropped += failed
        if inp.responses is None:
            continue
        seen.ids = set()
        tools = _scan_dataset(ds_index, inp, st, reporter, policy, ledger, multi_turn, seen, kept, done_bytes,
                              total_bytes, screen, [] if matches is None else matches) or tools
        done_bytes += inp.size(inp.responses)
    for st in per_ds:  # what the dataset cost: the ledger's figure, attempts without an answer included
        if ledger is not None and st.name in ledger.by_dataset:
            st.cost_all_usd = ledger.by_dataset[st.name]
    reporter.send(StageState.RUNNING, total_bytes, total_bytes, "read", unit="MB/s", scale=1e6, force=True)
    return kept, tools


def _count_failures(inp: DatasetInput, st: DatasetMergeStats) -> int:
    """failures.jsonl lines, counted as dropped ("failed"), by turn number for turns of conversations."""
    assert inp.failures is not None
    failed = 0
    for _, line in complete_lines(inp.failures, inp.size(inp.failures)):
        failed += 1
        if b'"turn"' in line:  # only turn lines are parsed: a failures file can be long
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            found = turn_of(record) if isinstance(record, dict) else None
            if found is not None:
                count_turn(st.by_turn, found[1], "failed")
    st.dropped["failed"] += failed
    st.read += failed
    return failed


def _scan_dataset(ds_index: int, inp: DatasetInput, st: DatasetMergeStats, reporter: _Reporter,
                  policy: SamplePolicy, ledger: SpendLedger | None, multi_turn: str, seen: _Seen,
                  kept: list[_Kept], done_bytes: int, total_bytes: int, screen: ContaminationFilter | None,
                  matches: list[Match]) -> bool:
    """One dataset's lines: single answers kept or dropped as read; turns of conversations held, then
    resolved per conversation (core/merge/turns.py). Returns whether a kept sample has tool calls.
    Samples left out as contaminated are added to `matches`."""
    assert inp.responses is not None
    tools = False
    refs = inp.read_token_index()
    ds_policy = _flag_sources(refs, st, policy)
    # An answer the ledger has no line for (carried or found from an older run) cost its usage.cost there too.
    costs = (ledger.answer_costs or {}).get(inp.name, {}) if ledger is not None else {}
    pending: list[PendingTurn] = []
    turn_matches: dict[str, Match] = {}  # a turn's match, by its id, until its conversation is resolved
    for offset, line in complete_lines(inp.responses, inp.size(inp.responses)):
        st.read += 1
        reporter.read += 1
        reason, ref, record, notes = _judge(line, refs, st, ds_policy)
        match = None
        if reason is None and record is not None and screen is not None:
            match = screen.judge(f"{inp.name}/{record['id']}", record)
            reason = "contaminated" if match is not None else None
        found = turn_of(record) if record is not None else None
        if found is not None and record is not None:
            pending.append(_pending(offset, len(line), found, reason, ref, notes, record, costs))
            if match is not None:
                turn_matches[str(record["id"])] = match
        else:
            key = b""
            if reason is None and record is not None:
                key = record_key(record)  # as `prompts build` and `run` see a duplicate (a turn: its prompt side)
                reason = _take(key, str(record["id"]), _cost(record, costs), notes, seen, st)
            if reason is None and record is not None and ref is not None:
                tools = tools or has_tool_calls(record)
                kept.append((ds_index, offset, len(line), ref.offset, ref.length, None))
            _tally(st, reporter, reason)
            if match is not None:
                _contaminated(st, matches, match)
        if st.read & 255 == 0:
            reporter.send(StageState.RUNNING, done_bytes + offset, total_bytes, f"reading {inp.name}",
                          unit="MB/s", scale=1e6)
    if pending:
        tools = _settle_turns(ds_index, pending, multi_turn, seen, st, reporter, kept) or tools
        for p in pending:  # a contaminated turn after a broken one is counted as after_invalid_turn
            if p.reason == "contaminated":
                _contaminated(st, matches, turn_matches[p.sample_id])
    st.by_turn = sorted_turns(st.by_turn)
    return tools


def _settle_turns(ds_index: int, pending: list[PendingTurn], multi_turn: str, seen: _Seen, st: DatasetMergeStats,
                  reporter: _Reporter, kept: list[_Kept]) -> bool:
    """A dataset's turn lines, resolved per conversation (core/merge/turns.py), kept or dropped in file
    order. A turn folded into its conversation's sample counts with that sample: its cost is the kept
    cost, and when the sample itself is a duplicate so is the turn."""
    tools = False
    resolve(pending, multi_turn)
    samples: set[str] = set()  # conversations with a kept sample
    for p in pending:
        if p.reason is None:
            p.reason = _take(p.key, p.sample_id, p.cost, p.notes, seen, st)
            if p.reason is None:
                samples.add(p.conversation)
    for p in pending:  # in file order
        if p.reason == "in_conversation":
            if p.conversation in samples:
                st.cost_usd += p.cost
            else:
                p.reason = "duplicate"
        if p.reason is None and p.ref is not None:
            tools = tools or p.tools
            kept.append((ds_index, p.offset, p.length, p.ref.offset, p.ref.length, p.history))
        count_turn(st.by_turn, p.turn, p.reason, diverged=p.diverged, replayed=p.replayed)
        _tally(st, reporter, p.reason)
    return tools


def _contaminated(st: DatasetMergeStats, matches: list[Match], match: Match) -> None:
    st.contaminated[match.benchmark] = st.contaminated.get(match.benchmark, 0) + 1
    matches.append(match)


def _tally(st: DatasetMergeStats, reporter: _Reporter, reason: str | None) -> None:
    if reason is None:
        st.kept += 1
        reporter.kept += 1
    else:
        st.dropped[reason] += 1
        reporter.dropped += 1


def _cost(record: dict[str, Any], costs: dict[str, float]) -> float:
    """The ledger's cost of an answer, else its usage.cost."""
    cost = costs.get(str(record.get("id")))
    return Usage.from_dict(record.get("usage")).cost if cost is None else cost


def _pending(offset: int, length: int, found: tuple[str, int], reason: str | None, ref: TokenRef | None,
             notes: tuple[str, ...], record: dict[str, Any], costs: dict[str, float]) -> PendingTurn:
    key = record_key(record) if reason is None else b""
    return PendingTurn(offset, length, found[0], found[1], reason, ref, notes, str(record["id"]), key,
                       _cost(record, costs), has_tool_calls(record), diverged=record.get("diverged") is True,
                       replayed=record.get("tool_results") == "replayed")


def _take(key: bytes, sample_id: str, cost: float, notes: tuple[str, ...], seen: _Seen,
          st: DatasetMergeStats) -> str | None:
    """Keep a clean sample unless its prompt (or its id) was kept before: "duplicate", else None."""
    if key in seen.keys or sample_id in seen.ids:
        return "duplicate"
    seen.keys.add(key)
    seen.ids.add(sample_id)
    st.cost_usd += cost
    for note in notes:
        st.kept_noted[note] = st.kept_noted.get(note, 0) + 1
    return None


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


def _judge(line: bytes, refs: dict[str, TokenRef], st: DatasetMergeStats, policy: SamplePolicy
           ) -> tuple[str | None, TokenRef | None, dict[str, Any] | None, tuple[str, ...]]:
    """(the reason the line is dropped or None, its token entry, the record, what a kept one differed in);
    duplicates are told later (`_take`)."""
    try:
        record = orjson.loads(line)
        sample_id = str(record["id"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "bad_line", None, None, ()
    if not isinstance(record, dict):
        return "bad_line", None, None, ()
    st.cost_all_usd += Usage.from_dict(record.get("usage")).cost
    ref = refs.get(sample_id)
    reason, notes = _drop_reason(record, ref, policy)
    if reason == "invalid":
        for check in (ref.failed_checks if ref is not None else ()) or ("unvalidated",):
            st.invalid_checks[check] = st.invalid_checks.get(check, 0) + 1
    return reason, ref, record, notes


def _write(inputs: list[DatasetInput], kept: list[_Kept], tmp: Path, stats: MergeStats,
           reporter: _Reporter, tool_calls_key: bool) -> None:
    """Pass 2: train.jsonl, tokens/ and train-tokens.jsonl in shuffled order, line k ↔ token entry k."""
    reporter.phase()
    total = len(kept)
    train_bytes = train_tokens_bytes = 0
    # A dataset has a kept line only if its responses file opened (pass 1 read it): -1 is never read.
    responses = [inp.responses.fileno() if inp.responses is not None else -1 for inp in inputs]
    # Buffered token files: the temporary folder is thrown away on any error, so no write needs to
    # be its own commit (three system calls a sample were a tenth of the merge).
    with open(tmp / TRAIN_FILE, "wb", buffering=1 << 20) as train, \
            open(tmp / TRAIN_TOKENS_FILE, "wb", buffering=1 << 20) as train_tokens, \
            TokenWriter(tmp / TOKENS_DIR, buffered=True) as tokens:
        for k, (ds_index, offset, line_length, tok_offset, tok_length, history) in enumerate(kept):
            inp, st = inputs[ds_index], stats.datasets[ds_index]
            record = orjson.loads(os.pread(responses[ds_index], line_length, offset))
            # A per-conversation sample is named by its conversation (its last good turn's line holds it all).
            sample_id = f"{inp.name}/{record['conversation'] if history is not None else record['id']}"
            line = orjson.dumps(specforge_record(sample_id, record, tool_calls_key=tool_calls_key,
                                                 system=stats.system_turn)) + b"\n"
            train.write(line)
            train_bytes += len(line)
            ids, mask = inp.token_arrays(tok_offset, tok_length)
            if history:  # every earlier assistant turn in the loss mask too (their reasoning is not in the ids)
                mask = mask.copy()
                for start, end in history:
                    mask[start:end] = 1
            tokens.append(sample_id, ids, mask, {"dataset": inp.name})
            train_tokens_bytes += _write_tokens_line(train_tokens, sample_id, ids, mask)
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
    stats.train_tokens_bytes = train_tokens_bytes
    for d in stats.datasets:
        d.cost_usd = round(d.cost_usd, 9)
        d.cost_all_usd = round(d.cost_all_usd, 9)
    reporter.send(StageState.RUNNING, total, total, "finishing", force=True)


def _write_tokens_line(out: Any, sample_id: str, ids: np.ndarray, mask: np.ndarray) -> int:
    """One train-tokens.jsonl line: the sample's id, token ids and 0/1 loss mask as written to tokens/."""
    line = orjson.dumps({"id": sample_id, "input_ids": ids, "loss_mask": mask},
                        option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    out.write(line)
    return len(line)


# ---------------------------------------------------------------------------------------------
# `draftgen merge CONFIG`


def _turns_table(stats: MergeStats) -> Any:
    """Turns of multi-turn conversations by turn number: read, kept, dropped by reason."""
    from rich.markup import escape
    from rich.table import Table
    by_turn = stats.by_turn
    reasons = sorted({r for row in by_turn.values() for r in row["dropped"]}, key=DROP_REASONS.index)
    flags = [f for f in AGENT_FLAGS if any(row.get(f) for row in by_turn.values())]  # agent steps only
    table = Table(title=escape(f"turns of conversations ([merge] multi_turn = \"{stats.multi_turn}\")"))
    for col in ("turn", "read", "kept", *reasons, *flags):
        table.add_column(col, justify="right")
    for k, row in by_turn.items():
        table.add_row(k, f"{row['read']:,}", f"{row['kept']:,}", *(f"{row['dropped'].get(r, 0):,}" for r in reasons),
                      *(f"{row.get(f, 0):,}" for f in flags))
    return table



def _print_turns_and_contamination(console: Any, stats: MergeStats) -> None:
    """The table of turns by number (multi-turn datasets) and the contamination filter's line, when there are."""
    from rich.markup import escape
    if stats.by_turn:
        console.print(_turns_table(stats))
    if stats.contamination:
        console.print(escape(contamination_line(stats)), soft_wrap=True, highlight=False)


def contamination_line(stats: MergeStats) -> str:
    """The contamination filter's drops by benchmark, and where the matches are (merge's output, the event)."""
    counts = stats.contamination.get("dropped", {})
    by = ", ".join(f"{visible(name)} {n:,}" for name, n in counts.items())
    return (f"contaminated (left out, by benchmark): {by}; matches in "
            f"{visible(str(Path(stats.output_dir) / contamination.REPORT_FILE))}")


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
    table = Table(title=f"merged → {escape(visible(stats.output_dir))} (seed {stats.seed})")
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
    _print_turns_and_contamination(console, stats)
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
            # The provider's name is the records' (an earlier version may have stored it raw): made safe here.
            console.print(f"[bold red]FLAGGED[/] {escape(d.name)} {escape(visible(f['provider']))}: "
                          f"{escape(visible(f['reason']))}; its samples {escape(what)}. To change: "
                          f"{escape(visible(f['fix']))}", soft_wrap=True, highlight=False)
    console.print(f"{stats.samples:,} samples written in {stats.elapsed_s:.1f} s (merge {stats.merge_id})",
                  highlight=False)
    if stats.hidden_states:
        console.print(escape(stats.hidden_states), soft_wrap=True, highlight=False)
    sys.stdout.flush()
    return 0
