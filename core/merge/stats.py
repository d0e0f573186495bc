"""What a merge counts: every dataset's tallies (read, kept, dropped by reason, tokens, cost), the
whole merge's figures written as stats.json (core/merge/merge.py, the file's fields at its top), and the
progress reporter that sends the running counts while both passes run."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from draftgen.core.live.progress import ProgressCallback, Throttle
from draftgen.core.live.snapshot import StageProgress, StageState
from draftgen.core.merge.inputs import InputFingerprint
from draftgen.core.merge.turns import TURN_REASONS, add_turns, sorted_turns
from draftgen.core.tokens.policy import NOTES

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


class MergeReporter:
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
