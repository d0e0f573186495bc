"""The validation report of a dataset's reconstructions: the checks of core/tokens/reconstruct.py
counted, the token-count differences summarised, what the sample policy would keep and drop, and
how each provider agrees (`<dataset>/tokens/report.json`, `draftgen tokens`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from draftgen.core.tokens.fidelity import (
    UNKNOWN,
    Agreement,
    Figures,
    ProviderFlag,
    TurnFigures,
    add_turn,
    flag_providers,
    merge_turns,
    percentile,
    turn_figures,
    turns_from_dict,
    turns_line,
    turns_to_dict,
)
from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import CHECKS, Reconstruction


@dataclass
class ValidationReport:
    """Validation outcomes of one dataset (or of all, `name="all"`).

    Beside the checks: what `policy` (core/tokens/policy.py) would keep and drop, and, per provider,
    how the answer and prompt token counts agree (core/tokens/fidelity.py)."""

    name: str = "all"
    checked: int = 0
    valid: int = 0
    truncated: int = 0
    from_backend: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKS, 0))
    diffs: dict[int, int] = field(default_factory=dict)   # span_tokens - billed -> answers
    billed_total: int = 0                                  # billed tokens of answers with a diff
    prompt_diffs: dict[int, int] = field(default_factory=dict)  # rendered prompt - usage.prompt_tokens
    kept: int = 0                                          # what the sample policy keeps
    dropped: dict[str, int] = field(default_factory=dict)  # ... and drops, by cause
    noted: dict[str, int] = field(default_factory=dict)    # kept samples that differed, by what
    providers: dict[str, Agreement] = field(default_factory=dict)
    policy: SamplePolicy = field(default_factory=SamplePolicy, repr=False, compare=False)
    prompt_from_backend: int = 0                           # answers with the server's prompt ids
    prompt_backend_match: int = 0                          # ... equal to the rendered prompt
    prompt_turns: dict[int, dict[int, int]] = field(default_factory=dict)  # turn number -> prompt_diffs

    def add_outcome(self, failed_checks: Iterable[str], count_diff: int | None, billed_tokens: int | None,
                    truncated: bool, source: str, *, prompt_diff: int | None = None,
                    provider: str | None = None, prompt_source: str | None = None,
                    turn: int | None = None, tool_calls: int = 0) -> None:
        failed = list(failed_checks)
        self.checked += 1
        # Given: used as the sample's prompt, or refused (ids outside the vocabulary) and so failed.
        if prompt_source == "backend" or "matches_backend_prompt" in failed:
            self.prompt_from_backend += 1
            self.prompt_backend_match += "matches_backend_prompt" not in failed
        self.valid += not failed
        self.truncated += bool(truncated)
        self.from_backend += source == "backend"
        for name in failed:
            self.failures[name] = self.failures.get(name, 0) + 1
        if count_diff is not None:
            self.diffs[count_diff] = self.diffs.get(count_diff, 0) + 1
            self.billed_total += int(billed_tokens or 0)
        if prompt_diff is not None:
            self.prompt_diffs[prompt_diff] = self.prompt_diffs.get(prompt_diff, 0) + 1
        add_turn(self.prompt_turns, turn, prompt_diff)
        verdict = self.policy.judge(failed, count_diff, billed_tokens, prompt_diff, provider)
        if truncated:
            self.dropped["truncated"] = self.dropped.get("truncated", 0) + 1
        elif verdict.keep:
            self.kept += 1
            for note in verdict.notes:
                self.noted[note] = self.noted.get(note, 0) + 1
        else:
            self.dropped[verdict.cause] = self.dropped.get(verdict.cause, 0) + 1
        backend = source == "backend" or "matches_backend" in failed
        agreement = self.providers.get(provider or UNKNOWN)
        if agreement is None:  # not setdefault: an Agreement made for every answer and thrown away costs ~0.4 us
            agreement = self.providers[provider or UNKNOWN] = Agreement()
        agreement.add(count_diff, billed_tokens, prompt_diff, backend=backend,
                      backend_match="matches_backend" not in failed, turn=turn, tool_calls=tool_calls,
                      foreign_ids="tool_call_ids" in failed)

    def add(self, r: Reconstruction) -> None:
        self.add_outcome(r.failed_checks, r.count_diff, r.billed_tokens, r.truncated, r.source,
                         prompt_diff=r.prompt_diff, provider=r.provider, prompt_source=r.prompt_source, turn=r.turn,
                         tool_calls=r.tool_calls)

    def add_meta(self, meta: Mapping[str, Any]) -> None:
        """Count one `tokens/index.jsonl` entry (its metadata fields)."""
        diff, pdiff, provider = meta.get("count_diff"), meta.get("prompt_diff"), meta.get("provider")
        turn, calls = meta.get("turn"), meta.get("tool_calls")
        self.add_outcome(meta.get("failed_checks") or (), diff if isinstance(diff, int) else None,
                         meta.get("billed_tokens"), bool(meta.get("truncated")), str(meta.get("source")),
                         prompt_diff=pdiff if isinstance(pdiff, int) else None,
                         provider=provider if isinstance(provider, str) else None,
                         prompt_source=str(meta.get("prompt_source")),
                         turn=turn if isinstance(turn, int) and not isinstance(turn, bool) else None,
                         tool_calls=calls if isinstance(calls, int) and not isinstance(calls, bool) else 0)

    def merge(self, other: ValidationReport) -> None:
        self.checked += other.checked
        self.valid += other.valid
        self.truncated += other.truncated
        self.from_backend += other.from_backend
        self.prompt_from_backend += other.prompt_from_backend
        self.prompt_backend_match += other.prompt_backend_match
        for name, n in other.failures.items():
            self.failures[name] = self.failures.get(name, 0) + n
        for diff, n in other.diffs.items():
            self.diffs[diff] = self.diffs.get(diff, 0) + n
        self.billed_total += other.billed_total
        for diff, n in other.prompt_diffs.items():
            self.prompt_diffs[diff] = self.prompt_diffs.get(diff, 0) + n
        merge_turns(self.prompt_turns, other.prompt_turns)
        self.kept += other.kept
        for mine, theirs in ((self.dropped, other.dropped), (self.noted, other.noted)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        for provider, agreement in other.providers.items():
            self.providers.setdefault(provider, Agreement()).merge(agreement)

    @classmethod
    def combine(cls, reports: Iterable[ValidationReport], name: str = "all") -> ValidationReport:
        reports = list(reports)
        total = cls(name, policy=reports[0].policy if reports else SamplePolicy())
        for r in reports:
            total.merge(r)
        return total

    # -- token-count difference ------------------------------------------------------------------

    @property
    def counted(self) -> int:
        return sum(self.diffs.values())

    @property
    def diff_mean(self) -> float | None:
        n = self.counted
        return sum(d * c for d, c in self.diffs.items()) / n if n else None

    @property
    def diff_abs_mean(self) -> float | None:
        n = self.counted
        return sum(abs(d) * c for d, c in self.diffs.items()) / n if n else None

    def diff_abs_percentile(self, q: float) -> int | None:
        absolute: dict[int, int] = {}
        for d, c in self.diffs.items():
            absolute[abs(d)] = absolute.get(abs(d), 0) + c
        return percentile(absolute, q)

    @property
    def share_exact(self) -> float | None:
        n = self.counted
        return self.diffs.get(0, 0) / n if n else None

    @property
    def diff_share_of_billed(self) -> float | None:
        """Sum of |diff| over the billed tokens: 0.0004 is the reference run's 0.04%."""
        if not self.billed_total:
            return None
        return sum(abs(d) * c for d, c in self.diffs.items()) / self.billed_total

    @property
    def prompt(self) -> Figures:
        """The rendered prompt's token count against usage.prompt_tokens."""
        return Figures.of(self.prompt_diffs)

    @property
    def prompt_by_turn(self) -> tuple[TurnFigures, ...]:
        """The prompt check per turn number of multi-turn answers (agreement share, mean diff); () without."""
        return turn_figures(self.prompt_turns)

    @property
    def prompt_mismatches(self) -> int:
        tol = self.policy.prompt_tolerance
        return sum(c for d, c in self.prompt_diffs.items() if abs(d) > tol)

    def flags(self, min_answers: int = 20, exact_gap: float = 0.25, ignore: Iterable[str] = (),
              exclude: Iterable[str] = (), min_exact_share: float | None = None) -> list[ProviderFlag]:
        return flag_providers(self.providers, min_answers=min_answers, exact_gap=exact_gap, ignore=ignore,
                              exclude=exclude, min_exact_share=min_exact_share)

    # -- output -----------------------------------------------------------------------------------

    def to_dict(self, flags: Iterable[ProviderFlag] = ()) -> dict[str, Any]:
        prompt = self.prompt
        return {
            "name": self.name, "checked": self.checked, "valid": self.valid, "invalid": self.checked - self.valid,
            "truncated": self.truncated, "from_backend": self.from_backend,
            "prompt_from_backend": self.prompt_from_backend, "prompt_backend_match": self.prompt_backend_match,
            "failures": {name: self.failures.get(name, 0) for name in CHECKS},
            "token_count_diff": {
                "answers": self.counted, "billed_total": self.billed_total, "mean": self.diff_mean,
                "mean_abs": self.diff_abs_mean,
                "p50_abs": self.diff_abs_percentile(50), "p99_abs": self.diff_abs_percentile(99),
                "share_exact": self.share_exact, "share_of_billed": self.diff_share_of_billed,
                "min": min(self.diffs) if self.diffs else None, "max": max(self.diffs) if self.diffs else None,
                "histogram": {str(d): self.diffs[d] for d in sorted(self.diffs)},
            },
            "prompt_token_count": {
                **prompt.to_dict(), "mismatches": self.prompt_mismatches,
                "histogram": {str(d): self.prompt_diffs[d] for d in sorted(self.prompt_diffs)},
            },
            "prompt_token_count_by_turn": turns_to_dict(self.prompt_turns),
            "policy": {**self.policy.to_dict(), "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                       "kept_noted": dict(sorted(self.noted.items()))},
            "providers": {p: self.providers[p].to_dict() for p in sorted(self.providers)},
            "provider_flags": [f.to_dict() for f in flags],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationReport:
        diff = data.get("token_count_diff") or {}
        prompt = data.get("prompt_token_count") or {}
        policy = data.get("policy") or {}
        return cls(str(data.get("name", "all")), int(data.get("checked", 0)), int(data.get("valid", 0)),
                   int(data.get("truncated", 0)), int(data.get("from_backend", 0)),
                   {**dict.fromkeys(CHECKS, 0), **{k: int(v) for k, v in (data.get("failures") or {}).items()}},
                   {int(k): int(v) for k, v in (diff.get("histogram") or {}).items()},
                   int(diff.get("billed_total") or 0),
                   {int(k): int(v) for k, v in (prompt.get("histogram") or {}).items()},
                   int(policy.get("kept") or 0), {k: int(v) for k, v in (policy.get("dropped") or {}).items()},
                   {k: int(v) for k, v in (policy.get("kept_noted") or {}).items()},
                   {p: Agreement.from_dict(a) for p, a in (data.get("providers") or {}).items()},
                   prompt_from_backend=int(data.get("prompt_from_backend") or 0),
                   prompt_backend_match=int(data.get("prompt_backend_match") or 0),
                   prompt_turns=turns_from_dict(data.get("prompt_token_count_by_turn")))

    def prompt_ids_line(self) -> str:
        """How the server's own prompt ids agree with the rendered prompts."""
        return (f"prompt ids from the server: {self.prompt_from_backend:,}, "
                f"agreeing {self.prompt_backend_match:,}")

    def summary_line(self) -> str:
        parts = [f"{self.name}: {self.checked:,} answers checked, {self.valid:,} valid"]
        failed = [f"{name} {n:,}" for name, n in self.failures.items() if n]
        if failed:
            parts.append("failed: " + ", ".join(failed))
        if self.counted:
            parts.append(f"token count vs billed: mean {self.diff_mean:+.2f}, p99 |diff| "
                         f"{self.diff_abs_percentile(99)}, exact {self.share_exact:.1%}")
        prompt = self.prompt
        if prompt.n:
            parts.append(f"prompt tokens exact {prompt.share_exact:.1%}")
        if len(self.prompt_turns) > 1:
            parts.append("prompt tokens by " + turns_line(self.prompt_turns))
        if rewritten := self.failures.get("text_matches_ids", 0):
            parts.append(rewritten_line(rewritten))
        if line := self.tool_ids_line():
            parts.append(line)
        return "; ".join(parts)

    def tool_ids_line(self) -> str:
        """Answers that called tools, and those whose call ids are not the model's own, by provider
        ("" without tool calls)."""
        tools = sum(a.tool_answers for a in self.providers.values())
        if not tools:
            return ""
        foreign = {p: a for p, a in sorted(self.providers.items()) if a.foreign_ids}
        line = f"answers calling tools: {tools:,}"
        if foreign:
            what = ("dropped as foreign_tool_call_id" if self.policy.limits.drop_foreign_tool_call_ids
                    else "kept, noted foreign_tool_call_id ([validation] drop_foreign_tool_call_ids = false)")
            line += (", with call ids not the model's own functions.NAME:IDX (a provider rewrote them, so the "
                     "rendered ids are not what the model generated; " + what + "): "
                     + ", ".join(f"{p} {a.foreign_ids:,} of {a.tool_answers:,}" for p, a in foreign.items()))
        return line

    def format(self, flags: Iterable[ProviderFlag] = ()) -> str:
        """A plain-text block (no rich markup) for logs and the headless runner."""
        lines = [f"{self.name}: {self.checked:,} answers checked, {self.valid:,} valid, "
                 f"{self.truncated:,} truncated, {self.from_backend:,} with backend ids"]
        width = max(len(c) for c in (*CHECKS, "prompt_token_count"))
        for name in CHECKS:
            lines.append(f"  {name:<{width}}  {self.failures.get(name, 0):>8,} failed")
        prompt = self.prompt
        lines.append(f"  {'prompt_token_count':<{width}}  {self.prompt_mismatches:>8,} differ"
                     + (f" (of {prompt.n:,} with usage.prompt_tokens)" if prompt.n else " (no usage.prompt_tokens)"))
        if self.prompt_turns:
            lines.append(f"  prompt tokens by {turns_line(self.prompt_turns)}")
        if self.prompt_from_backend:
            lines.append(f"  {self.prompt_ids_line()}")
        if rewritten := self.failures.get("text_matches_ids", 0):
            lines.append(f"  {rewritten_line(rewritten)}")
        if line := self.tool_ids_line():
            lines.append(f"  {line}")
        if self.counted:
            share = self.diff_share_of_billed
            lines.append(f"  token count - billed: mean {self.diff_mean:+.2f} (|diff| {self.diff_abs_mean:.2f}"
                         f"{f', {share:.2%} of billed' if share is not None else ''}), p50 |diff| "
                         f"{self.diff_abs_percentile(50)}, p99 |diff| {self.diff_abs_percentile(99)}, "
                         f"exact {self.share_exact:.1%} of {self.counted:,}")
        else:
            lines.append("  token count - billed: no billed counts")
        dropped = ", ".join(f"{k} {n:,}" for k, n in sorted(self.dropped.items()) if n) or "none"
        noted = ", ".join(f"{k} {n:,}" for k, n in sorted(self.noted.items()) if n)
        lines.append(f"  sample policy: keeps {self.kept:,}" + (f" ({noted})" if noted else "") + f", drops {dropped}")
        named = {p: a for p, a in self.providers.items() if a.answers}
        if named:
            lines.append(format_providers(named))
        for f in flags:
            lines.append(f"  FLAGGED {f.provider}: {f.reason}")
            if f.absolute:
                lines.append(f"    to change: {f.fix}")
                continue
            lines.append(f"    [request.provider] {f.ignore_line}" if f.ignore_line else f"    to change: {f.fix}")
            lines.append(f"    [merge] {f.exclude_line}")
        return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | int | None, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


PROVIDER_COLUMNS = ("provider", "answers", "exact", "mean|Δ|", "p99|Δ|", "prompt", "mean|Δ|", "p99|Δ|", "ids=")
PROVIDER_CAPTION = ("exact: answer tokens equal to the billed completion_tokens; prompt: rendered prompt tokens "
                    "equal to usage.prompt_tokens; |Δ| after each; ids=: returned ids equal to the reconstruction")


def provider_rows(providers: Mapping[str, Agreement]) -> list[tuple[str, ...]]:
    """One row of PROVIDER_COLUMNS per provider, most answers first."""
    rows: list[tuple[str, ...]] = []
    for name, a in sorted(providers.items(), key=lambda kv: (-kv[1].answers, kv[0])):
        ans, pr = a.answer, a.prompt
        rows.append((name, f"{a.answers:,}", _pct(ans.share_exact), _num(ans.mean_abs, ".2f"), _num(ans.p99_abs),
                     _pct(pr.share_exact), _num(pr.mean_abs, ".2f"), _num(pr.p99_abs),
                     f"{a.backend_match:,}/{a.backend:,}" if a.backend else "-"))
    return rows


def rewritten_line(n: int) -> str:
    """What answers whose text the server's ids do not decode to mean, and the fix."""
    return (f"the server's parser rewrote the text of {n:,} answer(s): their stored text is not what the server's "
            "own ids decode to (kept: the ids are what the model generated); for text as generated, set "
            "[api] stream = true or start the server without its reasoning/tool parser")


def format_providers(providers: Mapping[str, Agreement]) -> str:
    """The per-provider agreement as a plain-text table (answer: span vs billed; prompt: vs usage)."""
    rows = [PROVIDER_COLUMNS, *provider_rows(providers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PROVIDER_COLUMNS))]
    out = ["  per provider (exact: answer tokens equal to the billed completion_tokens; prompt: rendered",
           "  prompt tokens equal to usage.prompt_tokens; |Δ| after each; ids=: returned ids equal to ours)"]
    for r in rows:
        out.append("    " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)
