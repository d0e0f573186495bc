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

Here: the merge's steps in order and pass 2, the writing. Pass 1, which samples are kept and why the
others are dropped: core/merge/select.py; the tallies and stats.json: core/merge/stats.py; the
`draftgen merge` command's printout: core/merge/command.py.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from draftgen.core.config import Config
from draftgen.core.errors import ConfigError, DraftgenError
from draftgen.core.files import disk_error
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.progress import ProgressCallback
from draftgen.core.live.snapshot import StageState
from draftgen.core.merge import contamination
from draftgen.core.merge.contamination import ContaminationFilter, Match
from draftgen.core.merge.inputs import DatasetInput
from draftgen.core.merge.select import Kept, scan
from draftgen.core.merge.specforge import specforge_record
from draftgen.core.merge.stats import DatasetMergeStats, MergeReporter, MergeStats
from draftgen.core.merge.swap import TMP_PREFIX, fsync_tree, merge_lock, recover, switch
from draftgen.core.quoting import sh_path
from draftgen.core.records import stored_response
from draftgen.core.rundir import RunDir
from draftgen.core.tokens import identity
from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.store import TokenWriter

TRAIN_FILE, TOKENS_DIR, STATS_FILE = "train.jsonl", "tokens", "stats.json"
TRAIN_TOKENS_FILE = "train-tokens.jsonl"  # tokens/ as JSON lines: what an online trainer reads


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
    reporter = MergeReporter(progress)
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


def _merge_into(config: Config, root: Path, tmp: Path, reporter: MergeReporter,
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
        kept, tool_calls_key = scan(inputs, per_ds, reporter, policy, ledger, config.merge.multi_turn, screen, matches)
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


def _write(inputs: list[DatasetInput], kept: list[Kept], tmp: Path, stats: MergeStats,
           reporter: MergeReporter, tool_calls_key: bool) -> None:
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
            record = stored_response(orjson.loads(os.pread(responses[ds_index], line_length, offset)))
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
