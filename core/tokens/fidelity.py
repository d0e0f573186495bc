"""Provider fidelity: how well each provider's token counts agree with the reconstruction.

Per provider (as `provider` names it in responses.jsonl), for the answer (span tokens against the
billed `completion_tokens`) and the prompt (rendered prompt tokens against `usage.prompt_tokens`):
the share of exact counts, the mean and p99 |difference|, and, where the server returned its own
ids, how many equal the reconstruction. A provider serving another quantization or tokenizer shows
up as counts that disagree where the others agree: `flag_providers` names it, with the
`[request.provider] ignore` line that keeps future requests away from it and the `[merge]
exclude_providers` line that leaves its answers already paid for out of the training set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

UNKNOWN = "(unknown)"


def percentile(counts: Mapping[int, int], q: float) -> int | None:
    """Nearest-rank percentile of a value -> count histogram."""
    n = sum(counts.values())
    if n == 0:
        return None
    rank = max(1, math.ceil(q / 100 * n))
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def _absolute(h: Mapping[int, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for d, c in h.items():
        out[abs(d)] = out.get(abs(d), 0) + c
    return out


def _add(h: dict[int, int], other: Mapping[int, int]) -> None:
    for d, c in other.items():
        h[d] = h.get(d, 0) + c


@dataclass(frozen=True)
class Figures:
    """One histogram of differences summarised."""
    n: int
    share_exact: float | None
    mean_abs: float | None
    p99_abs: int | None

    @classmethod
    def of(cls, h: Mapping[int, int]) -> "Figures":
        n = sum(h.values())
        if not n:
            return cls(0, None, None, None)
        return cls(n, h.get(0, 0) / n, sum(abs(d) * c for d, c in h.items()) / n, percentile(_absolute(h), 99))

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "share_exact": self.share_exact, "mean_abs": self.mean_abs, "p99_abs": self.p99_abs}


@dataclass
class Agreement:
    """Token-count agreement of a set of answers: one provider's, or all of them."""
    diffs: dict[int, int] = field(default_factory=dict)          # answer span - billed completion_tokens
    billed: int = 0                                               # billed tokens of those answers
    prompt_diffs: dict[int, int] = field(default_factory=dict)   # rendered prompt - usage.prompt_tokens
    backend: int = 0                                              # answers that came with the server's ids
    backend_match: int = 0                                        # ... equal to the reconstruction

    def add(self, count_diff: int | None, billed: int | None, prompt_diff: int | None, *,
            backend: bool = False, backend_match: bool = False) -> None:
        if count_diff is not None:
            self.diffs[count_diff] = self.diffs.get(count_diff, 0) + 1
            self.billed += int(billed or 0)
        if prompt_diff is not None:
            self.prompt_diffs[prompt_diff] = self.prompt_diffs.get(prompt_diff, 0) + 1
        self.backend += backend
        self.backend_match += backend and backend_match

    def merge(self, other: "Agreement") -> None:
        _add(self.diffs, other.diffs)
        _add(self.prompt_diffs, other.prompt_diffs)
        self.billed += other.billed
        self.backend += other.backend
        self.backend_match += other.backend_match

    @property
    def answer(self) -> Figures:
        return Figures.of(self.diffs)

    @property
    def prompt(self) -> Figures:
        return Figures.of(self.prompt_diffs)

    @property
    def answers(self) -> int:
        return max(sum(self.diffs.values()), sum(self.prompt_diffs.values()), self.backend)

    @property
    def share_of_billed(self) -> float | None:
        return sum(abs(d) * c for d, c in self.diffs.items()) / self.billed if self.billed else None

    def to_dict(self) -> dict[str, Any]:
        return {"answer": {**self.answer.to_dict(), "share_of_billed": self.share_of_billed,
                           "histogram": {str(d): self.diffs[d] for d in sorted(self.diffs)}},
                "prompt": {**self.prompt.to_dict(),
                           "histogram": {str(d): self.prompt_diffs[d] for d in sorted(self.prompt_diffs)}},
                "billed": self.billed, "backend_ids": self.backend, "backend_match": self.backend_match}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Agreement":
        def hist(part: Any) -> dict[int, int]:
            h = (part or {}).get("histogram") or {} if isinstance(part, Mapping) else {}
            return {int(k): int(v) for k, v in h.items()}
        return cls(hist(data.get("answer")), int(data.get("billed") or 0), hist(data.get("prompt")),
                   int(data.get("backend_ids") or 0), int(data.get("backend_match") or 0))


@dataclass(frozen=True)
class ProviderFlag:
    provider: str
    reason: str
    ignore_line: str     # the [request.provider] ignore line with this provider added
    exclude_line: str    # the [merge] exclude_providers line with it added

    def to_dict(self) -> dict[str, str]:
        return {"provider": self.provider, "reason": self.reason, "ignore_line": self.ignore_line,
                "exclude_line": self.exclude_line}


def routing_name(provider: str) -> str:
    """The name to put in `provider.ignore` for a provider as responses name it ("Novita AI" -> "novita-ai").

    OpenRouter's routing takes the provider slug; the display name lower-cased with dashes for spaces
    is that slug for most providers (check the model's endpoints page when it is not)."""
    return "-".join(provider.strip().lower().split())


def toml_list(key: str, names: Iterable[str]) -> str:
    quoted = ", ".join('"' + n.replace("\\", "\\\\").replace('"', '\\"') + '"' for n in names)
    return f"{key} = [{quoted}]"


def flag_providers(providers: Mapping[str, Agreement], *, min_answers: int = 20, exact_gap: float = 0.25,
                   ignore: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[ProviderFlag]:
    """Providers whose counts depart from the others': a share of exact answer (or prompt) counts more
    than `exact_gap` below the other providers' pooled share, on at least `min_answers` answers each.

    With one provider there is nothing to compare with; its figures still show in the report."""
    named = {p: a for p, a in providers.items() if p != UNKNOWN}
    ignore, exclude = list(ignore), list(exclude)
    flags = []
    for name, mine in sorted(named.items()):
        others = Agreement()
        for other, a in named.items():
            if other != name:
                others.merge(a)
        reasons = []
        for what, me, them in (("answer", mine.answer, others.answer), ("prompt", mine.prompt, others.prompt)):
            if me.n < min_answers or them.n < min_answers or me.share_exact is None or them.share_exact is None:
                continue
            if them.share_exact - me.share_exact > exact_gap:
                reasons.append(f"{what} token counts exact in {me.share_exact:.0%} of {me.n:,} answers against "
                               f"{them.share_exact:.0%} for the other providers (mean |diff| {me.mean_abs:.1f} "
                               f"vs {them.mean_abs:.1f})")
        if reasons:
            slug = routing_name(name)
            flags.append(ProviderFlag(
                name, "; ".join(reasons) + ": another quantization or tokenizer?",
                toml_list("ignore", [*ignore, slug] if slug not in ignore else ignore),
                toml_list("exclude_providers", [*exclude, name] if name not in exclude else exclude)))
    return flags
