"""Pass 1 of a merge: every line of every dataset judged (dropped by its first reason, core/merge/stats.py
DROP_REASONS; a kept one first-seen by its prompt), and the kept samples remembered as small tuples
for pass 2 to write (core/merge/merge.py). Turns of multi-turn conversations are held until their
dataset is read, then resolved per conversation (core/merge/turns.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import orjson

from draftgen.core.dedupe import message_text, record_key
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.snapshot import StageState
from draftgen.core.merge.contamination import ContaminationFilter, Match
from draftgen.core.merge.inputs import DatasetInput, TokenRef, complete_lines
from draftgen.core.merge.specforge import has_tool_calls
from draftgen.core.merge.stats import DatasetMergeStats, MergeReporter
from draftgen.core.merge.turns import PendingTurn, count_turn, resolve, sorted_turns, turn_of
from draftgen.core.records import StoredResponse, Usage, answer_source, same_model, stored_response
from draftgen.core.tokens.fidelity import UNKNOWN, Agreement, flag_sources
from draftgen.core.tokens.policy import SamplePolicy, source_key


def _drop_reason(record: StoredResponse, ref: TokenRef | None,
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


# One kept sample: (dataset index, responses.jsonl offset and line length, token offset, token length,
# the earlier assistant turns its loss mask also covers: None for a sample as stored, the spans for a
# per-conversation sample).
Kept = tuple[int, int, int, int, int, "tuple[tuple[int, int], ...] | None"]


@dataclass
class _Seen:
    """What pass 1 has kept so far: prompt keys (across datasets) and one dataset's sample ids."""
    keys: set[bytes] = field(default_factory=set)
    # One dataset's kept ids: unique by contract; a repeat must not give two rows one id.
    ids: set[str] = field(default_factory=set)


def scan(inputs: list[DatasetInput], per_ds: list[DatasetMergeStats], reporter: MergeReporter, policy: SamplePolicy,
         ledger: SpendLedger | None = None, multi_turn: str = "per_turn", screen: ContaminationFilter | None = None,
         matches: list[Match] | None = None) -> tuple[list[Kept], bool]:
    """Pass 1: classify every answer, keep the clean first-seen ones as small tuples.

    Also says whether any kept prompt has tool calls (then every row gets the key, see top).
    """
    tools = False
    total_bytes = sum(inp.size(inp.responses) for inp in inputs)
    done_bytes = 0
    seen = _Seen()
    kept: list[Kept] = []
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


def _scan_dataset(ds_index: int, inp: DatasetInput, st: DatasetMergeStats, reporter: MergeReporter,
                  policy: SamplePolicy, ledger: SpendLedger | None, multi_turn: str, seen: _Seen,
                  kept: list[Kept], done_bytes: int, total_bytes: int, screen: ContaminationFilter | None,
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
                  reporter: MergeReporter, kept: list[Kept]) -> bool:
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


def _tally(st: DatasetMergeStats, reporter: MergeReporter, reason: str | None) -> None:
    if reason is None:
        st.kept += 1
        reporter.kept += 1
    else:
        st.dropped[reason] += 1
        reporter.dropped += 1


def _cost(record: StoredResponse, costs: dict[str, float]) -> float:
    """The ledger's cost of an answer, else its usage.cost."""
    cost = costs.get(str(record.get("id")))
    return Usage.from_dict(record.get("usage")).cost if cost is None else cost


def _pending(offset: int, length: int, found: tuple[str, int], reason: str | None, ref: TokenRef | None,
             notes: tuple[str, ...], record: StoredResponse, costs: dict[str, float]) -> PendingTurn:
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
           ) -> tuple[str | None, TokenRef | None, StoredResponse | None, tuple[str, ...]]:
    """(the reason the line is dropped or None, its token entry, the record, what a kept one differed in);
    duplicates are told later (`_take`)."""
    try:
        record = orjson.loads(line)
        sample_id = str(record["id"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "bad_line", None, None, ()
    if not isinstance(record, dict):
        return "bad_line", None, None, ()
    stored = stored_response(record)
    st.cost_all_usd += Usage.from_dict(stored.get("usage")).cost
    ref = refs.get(sample_id)
    reason, notes = _drop_reason(stored, ref, policy)
    if reason == "invalid":
        for check in (ref.failed_checks if ref is not None else ()) or ("unvalidated",):
            st.invalid_checks[check] = st.invalid_checks.get(check, 0) + 1
    return reason, ref, stored, notes
