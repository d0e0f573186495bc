"""Text answers back into the target tokenizer's exact ids, a loss mask, and validation checks.

Per answer: render the conversation with the chat template (core/tokens/template.py), encode each text
segment as ordinary text and insert each special token by id, then check the answer span
(after the `<think>` that opens the final assistant turn, through its `<|im_end|>`):

    renders          the conversation could be rendered at all (else nothing else is checked)
    one_think_close  exactly one `</think>` in the span, and it is the special token (a look-alike
                     typed in the text means the provider's reasoning split went wrong)
    no_think_open    no `<think>` in the span, as a token or as text (where the model itself opens
                     its reasoning, as with Qwen-style templates: exactly that one, first)
    ends_with_eot    the span ends with the end-of-turn token (never true for a truncated answer)
    round_trip       decoding the span's ids gives back the rendered text exactly (for our own ids
                     from a lossless byte-level BPE such as Kimi's: every text is valid Unicode,
                     which is the same thing; backend ids are always decoded)
    token_count      |span tokens - billed completion_tokens| <= tolerance (the exact diff is kept)
    matches_backend  the server's own completion ids equal the reconstruction, id for id

Beside the checks, the prompt: its token count (everything before the answer span, the generation
prompt's `<think>` included) against the provider's `usage.prompt_tokens`, kept as `prompt_diff`.
It is not a check of the answer, so it does not make a sample invalid; the report counts the
disagreements (`prompt_token_count`) per provider, and core/merge/policy.py decides what a sample's
checks and differences mean for merge (a BPE split keeps it, a leaked `<think>` drops it).

The loss mask is 1 from the `<think>` after the last assistant header through its `<|im_end|>`
(SpecForge's kimi-k2 convention), 0 elsewhere. Truncated answers (finish_reason "length") have no
end-of-turn token in reality, so none is rendered: they fail `ends_with_eot` by design and are never
clean. Where the backend returned completion ids, those ids are the span and the reconstruction is
only compared with them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from draftgen.core.errors import DraftgenError
from draftgen.core.merge.policy import SamplePolicy
from draftgen.core.tokens.fidelity import UNKNOWN, Agreement, Figures, ProviderFlag, flag_providers, percentile
from draftgen.core.tokens.template import ChatTemplate, Segment
from draftgen.core.tokens.tokenizer import Tokenizer

CHECKS = ("renders", "one_think_close", "no_think_open", "ends_with_eot", "round_trip", "token_count",
          "matches_backend")
DEFAULT_COUNT_TOLERANCE = 2
SOURCES = ("reconstructed", "backend")


@dataclass(frozen=True, eq=False)
class Reconstruction:
    input_ids: np.ndarray            # uint32 [T]
    loss_mask: np.ndarray            # uint8 [T], 0/1
    answer_start: int                # the answer span is input_ids[answer_start:answer_end]
    answer_end: int
    checks: dict[str, bool]          # checks that applied, by name (see CHECKS)
    failed_checks: tuple[str, ...]   # in CHECKS order
    span_tokens: int
    count_diff: int | None           # span_tokens - billed_tokens, None when nothing was billed
    source: str                      # "reconstructed" or "backend"
    billed_tokens: int | None = None
    truncated: bool = False
    error: str = ""                  # why the conversation could not be rendered
    prompt_tokens: int | None = None         # tokens before the answer span (None: not rendered)
    billed_prompt_tokens: int | None = None  # usage.prompt_tokens
    provider: str | None = None

    @property
    def valid(self) -> bool:
        return not self.failed_checks

    def index_meta(self) -> dict[str, Any]:
        """The metadata of this sample's `tokens/index.jsonl` line (documented in core/records.py)."""
        return {"answer_start": self.answer_start, "answer_end": self.answer_end, "valid": self.valid,
                "failed_checks": list(self.failed_checks), "span_tokens": self.span_tokens,
                "billed_tokens": self.billed_tokens, "count_diff": self.count_diff,
                "truncated": self.truncated, "source": self.source, "prompt_tokens": self.prompt_tokens,
                "billed_prompt_tokens": self.billed_prompt_tokens, "prompt_diff": self.prompt_diff,
                "provider": self.provider}

    @property
    def prompt_diff(self) -> int | None:
        """Reconstructed prompt tokens - usage.prompt_tokens (None when either is unknown)."""
        if self.prompt_tokens is None or self.billed_prompt_tokens is None:
            return None
        return self.prompt_tokens - self.billed_prompt_tokens


def encode_segments(tok: Tokenizer, segments: Iterable[Segment]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        if seg.special:
            ids.append(tok.special_id(seg.text))
        elif seg.text:
            ids.extend(tok.encode_text(seg.text))
    return ids


def unrenderable(error: str, *, billed_tokens: int | None = None, truncated: bool = False,
                 source: str = "reconstructed", provider: str | None = None) -> Reconstruction:
    """The outcome of an answer whose conversation could not be rendered: no tokens, `renders` failed."""
    checks = {"renders": False}
    return Reconstruction(np.zeros(0, np.uint32), np.zeros(0, np.uint8), 0, 0, checks, _finish(checks), 0, None,
                          source, billed_tokens, truncated, error, provider=provider)


def _valid_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _finish(checks: dict[str, bool]) -> tuple[str, ...]:
    return tuple(name for name in CHECKS if checks.get(name) is False)


def reconstruct(tok: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]], reasoning: str | None,
                content: str | None, *, billed_tokens: int | None = None, backend_ids: Sequence[int] | None = None,
                truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
                count_tolerance: int = DEFAULT_COUNT_TOLERANCE, verify_decode: bool = False,
                billed_prompt_tokens: int | None = None, provider: str | None = None) -> Reconstruction:
    """Token ids, loss mask and validation of one answer to `messages`.

    `verify_decode`: decode the span for `round_trip` even where the tokenizer is known lossless.
    `billed_prompt_tokens`: the provider's `usage.prompt_tokens`, compared with the rendered prompt.
    """
    source = "backend" if backend_ids is not None else "reconstructed"
    billed = int(billed_tokens) if billed_tokens is not None else None
    try:
        rendered = template.render(messages, reasoning, content or "", truncated=truncated, tool_calls=tool_calls)
        prompt_ids = encode_segments(tok, rendered.prompt)
        answer_ids = encode_segments(tok, rendered.answer)
        suffix_ids = encode_segments(tok, rendered.suffix)
        eot_id = tok.special_id(rendered.eot)
    except DraftgenError as e:
        return unrenderable(str(e), billed_tokens=billed, truncated=truncated, source=source, provider=provider)

    span = answer_ids
    backend_usable = False
    if backend_ids is not None:
        vocab = tok.vocab_size
        backend = [int(i) for i in backend_ids]
        # Ids the tokenizer does not have cannot be trained on: keep the reconstruction, flag the mismatch.
        backend_usable = all(0 <= i < vocab for i in backend)
        if backend_usable:
            span = backend
    answer_text = rendered.answer_text()
    if span is answer_ids and not verify_decode and getattr(tok, "lossless_text", False):
        # Our own ids from a byte-level BPE holding all 256 bytes (tiktoken): decoding them gives each
        # text back exactly unless it is not valid Unicode (a lone surrogate, which the encoder had to
        # replace). Checked that way, it costs a UTF-8 pass instead of a decode (~10% of the work).
        text = answer_text
        round_trip = _valid_unicode(answer_text)
    else:
        try:
            decoded: str | None = tok.decode(span)
        except Exception:  # ids that do not decode (a tokenizer's own error type)
            decoded = None
        text = decoded or ""
        round_trip = decoded is not None and decoded == answer_text
    # One uint32 buffer for the whole sample; the checks count ids on it at C speed.
    input_ids = np.frombuffer(array("I", prompt_ids + span + suffix_ids), dtype=np.uint32)
    start = len(prompt_ids)
    end = start + len(span)
    span_ids = input_ids[start:end]

    checks: dict[str, bool] = {"renders": True}
    if rendered.think_close is not None:
        close_id = tok.special_id(rendered.think_close)
        checks["one_think_close"] = (int(np.count_nonzero(span_ids == close_id)) == 1
                                     and text.count(rendered.think_close) == 1)
    if rendered.think_open is not None:
        open_id = tok.special_id(rendered.think_open)
        body, body_text, opened = span_ids, text, True
        if rendered.answer_opens_think:  # templates whose generation prompt leaves `<think>` to the model
            opened = len(span) > 0 and span[0] == open_id
            body, body_text = span_ids[1:], text.removeprefix(rendered.think_open)
        checks["no_think_open"] = (opened and not bool(np.any(body == open_id))
                                   and rendered.think_open not in body_text)
    checks["ends_with_eot"] = len(span) > 0 and span[-1] == eot_id
    checks["round_trip"] = round_trip
    count_diff = None
    if billed is not None:
        count_diff = len(span) - billed
        checks["token_count"] = abs(count_diff) <= count_tolerance
    if backend_ids is not None:
        checks["matches_backend"] = backend_usable and span == answer_ids
        source = "backend" if backend_usable else "reconstructed"

    loss_mask = np.zeros(input_ids.shape[0], dtype=np.uint8)
    loss_mask[start - rendered.mask_prompt_tail:end] = 1
    billed_prompt = int(billed_prompt_tokens) if billed_prompt_tokens else None  # 0: not reported
    return Reconstruction(input_ids, loss_mask, start, end, checks, _finish(checks), len(span), count_diff,
                          source, billed, truncated, prompt_tokens=start, billed_prompt_tokens=billed_prompt,
                          provider=provider)


def reconstruct_record(tok: Tokenizer, template: ChatTemplate, record: Mapping[str, Any], *,
                       count_tolerance: int = DEFAULT_COUNT_TOLERANCE) -> Reconstruction:
    """`reconstruct` of one responses.jsonl line (fields documented in core/records.py)."""
    usage = record.get("usage") or {}
    billed = usage.get("completion_tokens") if isinstance(usage, dict) else None
    billed_prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    truncated = bool(record.get("truncated")) or record.get("finish_reason") == "length"
    billed = billed if isinstance(billed, int) and not isinstance(billed, bool) else None
    billed_prompt = billed_prompt if isinstance(billed_prompt, int) and not isinstance(billed_prompt, bool) else None
    provider = record.get("provider")
    provider = provider if isinstance(provider, str) else None
    backend = record.get("token_ids")
    messages = record.get("messages")
    reasoning, content = record.get("reasoning"), record.get("content")
    for name, value in (("reasoning", reasoning), ("content", content)):
        if value is not None and not isinstance(value, str):
            return unrenderable(f"{name} must be a string, not {type(value).__name__}", billed_tokens=billed,
                                truncated=truncated, provider=provider)
    if backend is not None and not (isinstance(backend, list) and all(isinstance(i, int) for i in backend)):
        return unrenderable("token_ids must be a list of integers", billed_tokens=billed, truncated=truncated,
                            source="backend", provider=provider)
    return reconstruct(tok, template, messages if isinstance(messages, list) else [], reasoning, content or "",
                       billed_tokens=billed, backend_ids=backend, truncated=truncated,
                       tool_calls=record.get("tool_calls") or None, count_tolerance=count_tolerance,
                       billed_prompt_tokens=billed_prompt, provider=provider)


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class ValidationReport:
    """Validation outcomes of one dataset (or of all, `name="all"`).

    Beside the checks: what `policy` (core/merge/policy.py) would keep and drop, and, per provider,
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

    def add_outcome(self, failed_checks: Iterable[str], count_diff: int | None, billed_tokens: int | None,
                    truncated: bool, source: str, *, prompt_diff: int | None = None,
                    provider: str | None = None) -> None:
        failed = list(failed_checks)
        self.checked += 1
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
        agreement = self.providers.setdefault(provider or UNKNOWN, Agreement())
        agreement.add(count_diff, billed_tokens, prompt_diff, backend=backend,
                      backend_match="matches_backend" not in failed)

    def add(self, r: Reconstruction) -> None:
        self.add_outcome(r.failed_checks, r.count_diff, r.billed_tokens, r.truncated, r.source,
                         prompt_diff=r.prompt_diff, provider=r.provider)

    def add_meta(self, meta: Mapping[str, Any]) -> None:
        """Count one `tokens/index.jsonl` entry (its metadata fields)."""
        diff, pdiff, provider = meta.get("count_diff"), meta.get("prompt_diff"), meta.get("provider")
        self.add_outcome(meta.get("failed_checks") or (), diff if isinstance(diff, int) else None,
                         meta.get("billed_tokens"), bool(meta.get("truncated")), str(meta.get("source")),
                         prompt_diff=pdiff if isinstance(pdiff, int) else None,
                         provider=provider if isinstance(provider, str) else None)

    def merge(self, other: "ValidationReport") -> None:
        self.checked += other.checked
        self.valid += other.valid
        self.truncated += other.truncated
        self.from_backend += other.from_backend
        for name, n in other.failures.items():
            self.failures[name] = self.failures.get(name, 0) + n
        for diff, n in other.diffs.items():
            self.diffs[diff] = self.diffs.get(diff, 0) + n
        self.billed_total += other.billed_total
        for diff, n in other.prompt_diffs.items():
            self.prompt_diffs[diff] = self.prompt_diffs.get(diff, 0) + n
        self.kept += other.kept
        for mine, theirs in ((self.dropped, other.dropped), (self.noted, other.noted)):
            for k, n in theirs.items():
                mine[k] = mine.get(k, 0) + n
        for provider, agreement in other.providers.items():
            self.providers.setdefault(provider, Agreement()).merge(agreement)

    @classmethod
    def combine(cls, reports: Iterable["ValidationReport"], name: str = "all") -> "ValidationReport":
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
    def prompt_mismatches(self) -> int:
        tol = self.policy.prompt_tolerance
        return sum(c for d, c in self.prompt_diffs.items() if abs(d) > tol)

    def flags(self, min_answers: int = 20, exact_gap: float = 0.25, ignore: Iterable[str] = (),
              exclude: Iterable[str] = ()) -> list[ProviderFlag]:
        return flag_providers(self.providers, min_answers=min_answers, exact_gap=exact_gap, ignore=ignore,
                              exclude=exclude)

    # -- output -----------------------------------------------------------------------------------

    def to_dict(self, flags: Iterable[ProviderFlag] = ()) -> dict[str, Any]:
        prompt = self.prompt
        return {
            "name": self.name, "checked": self.checked, "valid": self.valid, "invalid": self.checked - self.valid,
            "truncated": self.truncated, "from_backend": self.from_backend,
            "failures": {name: self.failures.get(name, 0) for name in CHECKS},
            "token_count_diff": {
                "answers": self.counted, "billed_total": self.billed_total, "mean": self.diff_mean, "mean_abs": self.diff_abs_mean,
                "p50_abs": self.diff_abs_percentile(50), "p99_abs": self.diff_abs_percentile(99),
                "share_exact": self.share_exact, "share_of_billed": self.diff_share_of_billed,
                "min": min(self.diffs) if self.diffs else None, "max": max(self.diffs) if self.diffs else None,
                "histogram": {str(d): self.diffs[d] for d in sorted(self.diffs)},
            },
            "prompt_token_count": {
                **prompt.to_dict(), "mismatches": self.prompt_mismatches,
                "histogram": {str(d): self.prompt_diffs[d] for d in sorted(self.prompt_diffs)},
            },
            "policy": {**self.policy.to_dict(), "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                       "kept_noted": dict(sorted(self.noted.items()))},
            "providers": {p: self.providers[p].to_dict() for p in sorted(self.providers)},
            "provider_flags": [f.to_dict() for f in flags],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ValidationReport":
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
                   {p: Agreement.from_dict(a) for p, a in (data.get("providers") or {}).items()})

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
        return "; ".join(parts)

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
            lines.append(f"    [request.provider] {f.ignore_line}")
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
    rows = []
    for name, a in sorted(providers.items(), key=lambda kv: (-kv[1].answers, kv[0])):
        ans, pr = a.answer, a.prompt
        rows.append((name, f"{a.answers:,}", _pct(ans.share_exact), _num(ans.mean_abs, ".2f"), _num(ans.p99_abs),
                     _pct(pr.share_exact), _num(pr.mean_abs, ".2f"), _num(pr.p99_abs),
                     f"{a.backend_match:,}/{a.backend:,}" if a.backend else "-"))
    return rows


def format_providers(providers: Mapping[str, Agreement]) -> str:
    """The per-provider agreement as a plain-text table (answer: span vs billed; prompt: vs usage)."""
    rows = [PROVIDER_COLUMNS, *provider_rows(providers)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PROVIDER_COLUMNS))]
    out = ["  per provider (exact: answer tokens equal to the billed completion_tokens; prompt: rendered",
           "  prompt tokens equal to usage.prompt_tokens; |Δ| after each; ids=: returned ids equal to ours)"]
    for r in rows:
        out.append("    " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)
