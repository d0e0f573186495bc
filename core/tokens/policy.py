"""Which reconstructed samples are clean, by cause: a broken structure drops a sample, a BPE split does not.

Reconstruction (core/tokens/reconstruct.py) records facts per answer: the checks that failed, the
answer's token count against the billed `completion_tokens`, the prompt's against `usage.prompt_tokens`,
the provider. This policy turns them into keep or drop, with the cause:

    structural   renders, one_think_close, no_think_open, ends_with_eot, round_trip failed: the
                 answer is not a well-formed assistant turn (no or two `</think>`, a leaked `<think>`,
                 no end-of-turn, text that does not decode); also any check this policy does not
                 know. Dropped as "invalid".
    count        |span - billed| <= count_tolerance: agrees. Beyond that but within split_share of the
                 billed answer: a BPE split (the provider's detokenize/retokenize boundary, not another
                 model); kept and reported, since extraction recomputes hidden states on our ids anyway.
                 Beyond: dropped as "count_mismatch" (another model, quantization or tokenizer).
    prompt       |prompt - usage.prompt_tokens| > prompt_tolerance: the prompt the row trains on is not
                 the one the provider ran. Reported; dropped as "prompt_mismatch" only with
                 drop_prompt_mismatch (a wrong system turn makes every row disagree: the smoke test
                 fails on it before a run starts).
    backend      the server's own ids differ from the reconstruction: the server's ids are the sample
                 (they are what the model generated), the disagreement is reported, never a drop;
                 likewise its prompt ids (`matches_backend_prompt`: they are what the model saw), and
                 a stored text its ids do not decode to (`text_matches_ids`: the server's parser
                 rewrote the text; noted "text_rewritten").
    tool ids     an answer's tool calls rendered from ids that are not the model's own shape
                 (`tool_call_ids`: a provider rewrote `functions.NAME:IDX` to `call_…`): the sample's
                 ids are not what the model generated. Dropped as "foreign_tool_call_id" while
                 drop_foreign_tool_call_ids is set (else kept, noted "foreign_tool_call_id").
    provider     answers of a provider in [merge] exclude_providers are dropped as "provider_excluded".
    model        the merge drops an answer whose `model` is not `[api] model` (core/records.py same_model)
                 as "other_model", whichever run wrote it (`model`: the model asked, from the config).
    source       answers of a source flagged on its own (core/tokens/fidelity.py flag_sources: a
                 self-hosted server or provider with few exact counts or a constant offset, so its
                 text or template is not what the model saw) are dropped as "source_flagged" while
                 drop_flagged_sources is set (else kept, noted "source_flagged"); merge says why.

Thresholds are `[validation]` in the config (core/config_tables.py ValidationConfig); the defaults keep the
reference run's splits (mean 1.0 token on ~2,300-token answers, at most a few tokens) and drop a
3 % count difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from draftgen.core.config import Config
from draftgen.core.config_tables import ValidationConfig
from draftgen.core.tokens.fidelity import UNKNOWN

STRUCTURAL = ("renders", "one_think_close", "no_think_open", "ends_with_eot", "round_trip")
# Checks that measure a difference rather than a broken structure: judged by size, never dropped as invalid.
MEASURES = frozenset({"token_count", "matches_backend", "matches_backend_prompt", "text_matches_ids",
                      "tool_call_ids"})
# Kept samples noted by what differed (stats.json "kept_noted").
NOTES = ("count_split", "prompt_mismatch", "backend_mismatch", "backend_prompt_mismatch", "text_rewritten",
         "source_flagged", "foreign_tool_call_id")


def provider_key(name: Any) -> str:
    """A provider name as routing compares it: lower case, letters and digits only."""
    return "".join(ch for ch in str(name or "").lower() if ch.isalnum())


def source_key(name: Any) -> str:
    """provider_key, with no provider (a self-hosted server) as the report names it, "(unknown)"."""
    return provider_key(name) or provider_key(UNKNOWN)


@dataclass(frozen=True)
class SampleVerdict:
    keep: bool
    cause: str                               # drop reason, or "" when kept
    notes: tuple[str, ...] = ()              # what a kept sample differed in (NOTES)


_CLEAN = SampleVerdict(True, "")  # what `judge` says of a sample nothing failed or differed in


@dataclass(frozen=True)
class SamplePolicy:
    limits: ValidationConfig = field(default_factory=ValidationConfig)  # the config's [validation]
    exclude_providers: frozenset[str] = field(default_factory=frozenset)  # provider_key()s
    flagged_sources: frozenset[str] = field(default_factory=frozenset)    # source_key()s flagged on their own
    model: str = ""                                                       # [api] model ("": not judged)

    @classmethod
    def from_config(cls, config: Config) -> SamplePolicy:
        return cls(config.validation, frozenset(provider_key(p) for p in config.merge.exclude_providers),
                   model=config.api.model)

    @property
    def count_tolerance(self) -> int:
        return self.limits.count_tolerance

    @property
    def prompt_tolerance(self) -> int:
        return self.limits.prompt_tolerance

    def count_limit(self, billed: int | None) -> float:
        """The largest |count diff| kept for an answer billed `billed` tokens."""
        return max(self.count_tolerance, self.limits.split_share * (billed or 0))

    def judge(self, failed_checks: Iterable[str], count_diff: int | None, billed: int | None,
              prompt_diff: int | None = None, provider: Any = None) -> SampleVerdict:
        if (not failed_checks and not self.exclude_providers and not self.flagged_sources
                and (count_diff is None or abs(count_diff) <= self.limits.count_tolerance)
                and (prompt_diff is None or abs(prompt_diff) <= self.limits.prompt_tolerance)):
            return _CLEAN  # most answers (a token worker judges each): no rule drops or notes it
        return self._by_rules(set(failed_checks), count_diff, billed, prompt_diff, provider)

    def _by_rules(self, failed: set[str], count_diff: int | None, billed: int | None, prompt_diff: int | None,
                  provider: Any) -> SampleVerdict:
        if self.exclude_providers and provider_key(provider) in self.exclude_providers:
            return SampleVerdict(False, "provider_excluded")
        if failed - MEASURES:  # the structural checks, and any check this policy does not know
            return SampleVerdict(False, "invalid")
        notes = []
        # Before the counts: rewritten call ids change the answer's length too, and they are the cause.
        if "tool_call_ids" in failed:
            if self.limits.drop_foreign_tool_call_ids:
                return SampleVerdict(False, "foreign_tool_call_id")
            notes.append("foreign_tool_call_id")
        if count_diff is not None and abs(count_diff) > self.count_tolerance:
            if abs(count_diff) > self.count_limit(billed):
                return SampleVerdict(False, "count_mismatch")
            notes.append("count_split")
        elif count_diff is None and "token_count" in failed:  # an old store without the diff
            return SampleVerdict(False, "count_mismatch")
        if prompt_diff is not None and abs(prompt_diff) > self.prompt_tolerance:
            if self.limits.drop_prompt_mismatch:
                return SampleVerdict(False, "prompt_mismatch")
            notes.append("prompt_mismatch")
        if "matches_backend" in failed:
            notes.append("backend_mismatch")
        if "matches_backend_prompt" in failed:
            notes.append("backend_prompt_mismatch")
        if "text_matches_ids" in failed:
            notes.append("text_rewritten")
        # Last: a sample the other rules drop keeps their cause; the ones they keep are its source's.
        if self.flagged_sources and source_key(provider) in self.flagged_sources:
            if self.limits.drop_flagged_sources:
                return SampleVerdict(False, "source_flagged")
            notes.append("source_flagged")
        return SampleVerdict(True, "", tuple(notes))

    def judge_meta(self, meta: dict[str, Any], provider: Any = None) -> SampleVerdict:
        """`judge` of one tokens/index.jsonl entry (fields documented in core/records.py)."""
        diff, billed, pdiff = meta.get("count_diff"), meta.get("billed_tokens"), meta.get("prompt_diff")
        return self.judge(meta.get("failed_checks") or (), diff if isinstance(diff, int) else None,
                          billed if isinstance(billed, int) else None, pdiff if isinstance(pdiff, int) else None,
                          provider if provider is not None else meta.get("provider"))

    def to_dict(self) -> dict[str, Any]:
        v = self.limits
        return {"count_tolerance": v.count_tolerance, "split_share": v.split_share,
                "prompt_tolerance": v.prompt_tolerance, "drop_prompt_mismatch": v.drop_prompt_mismatch,
                "exclude_providers": sorted(self.exclude_providers), "structural_checks": list(STRUCTURAL),
                "min_exact_share": v.min_exact_share, "drop_flagged_sources": v.drop_flagged_sources,
                "drop_foreign_tool_call_ids": v.drop_foreign_tool_call_ids,
                "model": self.model}
