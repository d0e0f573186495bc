"""Provider fidelity: how well each provider's token counts agree with the reconstruction.

Per provider (as `provider` names it in responses.jsonl), for the answer (span tokens against the
billed `completion_tokens`) and the prompt (rendered prompt tokens against `usage.prompt_tokens`):
the share of exact counts, the mean and p99 |difference|, and, where the server returned its own
ids, how many equal the reconstruction. The prompt's agreement is also kept per turn number of a
multi-turn dataset (`prompt_turns`, a `TurnFigures` per turn): the history each turn sends back is
rendered by the template's history rule, and turn k's prompt counts agreeing is what proves that
rendering is the server's. Answers that call tools are counted too (`tool_answers`), and those whose
call ids are not the model's own `functions.NAME:IDX` (`foreign_ids`: the provider rewrote them, so
the rendered answer is not what the model generated). A provider serving another quantization or tokenizer shows
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
    def of(cls, h: Mapping[int, int]) -> Figures:
        n = sum(h.values())
        if not n:
            return cls(0, None, None, None)
        return cls(n, h.get(0, 0) / n, sum(abs(d) * c for d, c in h.items()) / n, percentile(_absolute(h), 99))

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "share_exact": self.share_exact, "mean_abs": self.mean_abs, "p99_abs": self.p99_abs}


@dataclass(frozen=True)
class TurnFigures:
    """The prompt check of one turn number: rendered prompt tokens - usage.prompt_tokens."""
    turn: int
    n: int
    share_exact: float | None
    mean_diff: float | None     # signed: + the rendering has more tokens than the provider counted
    mean_abs: float | None

    @classmethod
    def of(cls, turn: int, h: Mapping[int, int]) -> TurnFigures:
        n = sum(h.values())
        if not n:
            return cls(turn, 0, None, None, None)
        return cls(turn, n, h.get(0, 0) / n, sum(d * c for d, c in h.items()) / n,
                   sum(abs(d) * c for d, c in h.items()) / n)

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "share_exact": self.share_exact, "mean_diff": self.mean_diff, "mean_abs": self.mean_abs}


def turn_figures(turns: Mapping[int, Mapping[int, int]]) -> tuple[TurnFigures, ...]:
    """Per turn number (ascending), the prompt check's figures."""
    return tuple(TurnFigures.of(k, turns[k]) for k in sorted(turns))


def add_turn(turns: dict[int, dict[int, int]], turn: int | None, diff: int | None) -> None:
    """Count one prompt difference under its turn number (nothing when either is unknown)."""
    if turn is not None and diff is not None:
        h = turns.setdefault(turn, {})
        h[diff] = h.get(diff, 0) + 1


def merge_turns(mine: dict[int, dict[int, int]], theirs: Mapping[int, Mapping[int, int]]) -> None:
    for turn, h in theirs.items():
        _add(mine.setdefault(turn, {}), h)


def turns_to_dict(turns: Mapping[int, Mapping[int, int]]) -> dict[str, Any]:
    """{"k": {n, share_exact, mean_diff, mean_abs, histogram}} per turn number."""
    return {str(f.turn): {**f.to_dict(), "histogram": {str(d): turns[f.turn][d] for d in sorted(turns[f.turn])}}
            for f in turn_figures(turns)}


def turns_from_dict(data: Any) -> dict[int, dict[int, int]]:
    if not isinstance(data, Mapping):
        return {}
    return {int(k): {int(d): int(c) for d, c in ((v or {}).get("histogram") or {}).items()}
            for k, v in data.items() if isinstance(v, Mapping)}


def turns_line(turns: Mapping[int, Mapping[int, int]]) -> str:
    """"turn 1: exact 100.0% (mean diff +0.00) of 30; turn 2: ..." ("" without multi-turn answers)."""
    return "; ".join(f"turn {f.turn}: exact {f.share_exact:.1%} (mean diff {f.mean_diff:+.2f}) of {f.n:,}"
                     for f in turn_figures(turns) if f.n and f.share_exact is not None and f.mean_diff is not None)


@dataclass
class Agreement:
    """Token-count agreement of a set of answers: one provider's, or all of them."""
    diffs: dict[int, int] = field(default_factory=dict)          # answer span - billed completion_tokens
    billed: int = 0                                               # billed tokens of those answers
    prompt_diffs: dict[int, int] = field(default_factory=dict)   # rendered prompt - usage.prompt_tokens
    backend: int = 0                                              # answers that came with the server's ids
    backend_match: int = 0                                        # ... equal to the reconstruction
    prompt_turns: dict[int, dict[int, int]] = field(default_factory=dict)  # turn number -> prompt_diffs
    tool_answers: int = 0                                         # answers that called tools
    foreign_ids: int = 0                                          # ... whose call ids are not the model's shape

    def add(self, count_diff: int | None, billed: int | None, prompt_diff: int | None, *,
            backend: bool = False, backend_match: bool = False, turn: int | None = None,
            tool_calls: int = 0, foreign_ids: bool = False) -> None:
        if count_diff is not None:
            self.diffs[count_diff] = self.diffs.get(count_diff, 0) + 1
            self.billed += int(billed or 0)
        if prompt_diff is not None:
            self.prompt_diffs[prompt_diff] = self.prompt_diffs.get(prompt_diff, 0) + 1
        add_turn(self.prompt_turns, turn, prompt_diff)
        self.backend += backend
        self.backend_match += backend and backend_match
        self.tool_answers += tool_calls > 0
        self.foreign_ids += foreign_ids

    def merge(self, other: Agreement) -> None:
        _add(self.diffs, other.diffs)
        _add(self.prompt_diffs, other.prompt_diffs)
        self.billed += other.billed
        self.backend += other.backend
        self.backend_match += other.backend_match
        merge_turns(self.prompt_turns, other.prompt_turns)
        self.tool_answers += other.tool_answers
        self.foreign_ids += other.foreign_ids

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
                "billed": self.billed, "backend_ids": self.backend, "backend_match": self.backend_match,
                **({"prompt_by_turn": turns_to_dict(self.prompt_turns)} if self.prompt_turns else {}),
                **({"tool_answers": self.tool_answers, "foreign_tool_call_ids": self.foreign_ids}
                   if self.tool_answers else {})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Agreement:
        def hist(part: Any) -> dict[int, int]:
            h = (part or {}).get("histogram") or {} if isinstance(part, Mapping) else {}
            return {int(k): int(v) for k, v in h.items()}
        return cls(hist(data.get("answer")), int(data.get("billed") or 0), hist(data.get("prompt")),
                   int(data.get("backend_ids") or 0), int(data.get("backend_match") or 0),
                   turns_from_dict(data.get("prompt_by_turn")), int(data.get("tool_answers") or 0),
                   int(data.get("foreign_tool_call_ids") or 0))


@dataclass(frozen=True)
class ProviderFlag:
    provider: str
    reason: str
    ignore_line: str     # the [request.provider] ignore line with this provider added
    exclude_line: str    # the [merge] exclude_providers line with it added

    # for a source judged on its own, or a fleet's server (no ignore line): what to change
    fix: str = ""
    absolute: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "reason": self.reason, "ignore_line": self.ignore_line,
                "exclude_line": self.exclude_line, "fix": self.fix, "absolute": self.absolute}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProviderFlag:
        return cls(str(data.get("provider", "")), str(data.get("reason", "")), str(data.get("ignore_line", "")),
                   str(data.get("exclude_line", "")), str(data.get("fix", "")), bool(data.get("absolute")))


def routing_name(provider: str) -> str:
    """The name to put in `provider.ignore` for a provider as responses name it ("Novita AI" -> "novita-ai").

    OpenRouter's routing takes the provider slug; the display name lower-cased with dashes for spaces
    is that slug for most providers (check the model's endpoints page when it is not)."""
    return "-".join(provider.strip().lower().split())


def toml_list(key: str, names: Iterable[str]) -> str:
    quoted = ", ".join('"' + n.replace("\\", "\\\\").replace('"', '\\"') + '"' for n in names)
    return f"{key} = [{quoted}]"


def count_mode(h: Mapping[int, int]) -> tuple[int, float] | None:
    """The most common difference of a histogram and its share (ties: the smallest |difference|)."""
    n = sum(h.values())
    if not n:
        return None
    d = min(h, key=lambda k: (-h[k], abs(k), k))
    return d, h[d] / n


def absolute_cause(h: Mapping[int, int], min_exact_share: float) -> tuple[str, str] | None:
    """Why one source's answer counts are off on their own, and what to change; None when they agree.

    A constant offset (the same non-zero difference for most answers) is a template disagreement: the
    generation prompt or the end of turn renders a token more or less than the server's. Scattered small
    differences on short answers are text the server rewrote after generating it (a reasoning parser
    stripping whitespace in non-streamed answers), or another tokenizer when they are large."""
    mode = count_mode(h)
    if mode is None:
        return None
    n = sum(h.values())
    exact = h.get(0, 0) / n
    d, share = mode
    if d != 0 and share >= 0.5:
        return (f"{share:.0%} of {n:,} answers are {d:+d} token{'s' if abs(d) != 1 else ''} off the billed count "
                f"(exact {exact:.0%}): a constant offset, so the chat template differs from the server's "
                f"(its generation prompt or end of turn)",
                "render the server's own template: [tokenizer] template = \"auto\" with the served model's "
                "tokenizer (or fix the template the server was started with), then `draftgen tokens` again")
    if d != 0 or exact < min_exact_share:
        mean = sum(abs(k) * c for k, c in h.items()) / n
        if mean <= 3:
            return (f"answer token counts exact in {exact:.0%} of {n:,} answers (mean |diff| {mean:.1f}): the "
                    f"answer text is not what the model generated (a reasoning parser rewriting whitespace, "
                    f"typically in non-streamed answers)",
                    "[api] stream = true (the streamed text is the generated text), or on vLLM/SGLang "
                    "[api] return_token_ids = true (the server's own ids)")
        return (f"answer token counts exact in {exact:.0%} of {n:,} answers (mean |diff| {mean:.1f}): another "
                f"tokenizer or model than [tokenizer] path",
                "point [tokenizer] path at the served model's own tokenizer")
    return None


def flag_sources(providers: Mapping[str, Agreement], *, min_answers: int = 20,
                 min_exact_share: float = 0.75, exclude: Iterable[str] = ()) -> list[ProviderFlag]:
    """Each source (a provider, or a self-hosted server: "(unknown)") judged on its own, with no
    other to compare with: few exact answer counts, or a constant non-zero difference."""
    flags = []
    exclude = list(exclude)
    for name, mine in sorted(providers.items()):
        if mine.answer.n < min_answers:
            continue
        cause = absolute_cause(mine.diffs, min_exact_share)
        if cause is None:
            continue
        reason, fix = cause
        flags.append(ProviderFlag(name, reason, "", toml_list("exclude_providers",
                                                            [*exclude, name] if name not in exclude else exclude)
                                  if name != UNKNOWN else "", fix, True))
    return flags


def flag_providers(providers: Mapping[str, Agreement], *, min_answers: int = 20, exact_gap: float = 0.25,
                   ignore: Iterable[str] = (), exclude: Iterable[str] = (),
                   min_exact_share: float | None = None) -> list[ProviderFlag]:
    """Providers whose counts depart from the others': a share of exact answer (or prompt) counts more
    than `exact_gap` below the other providers' pooled share, on at least `min_answers` answers each.

    With `min_exact_share`, a source not flagged that way is also judged on its own (`flag_sources`):
    with one provider, or a self-hosted server, there is nothing else to compare with."""
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
        if reasons and name.startswith(("http://", "https://")):  # a fleet's server: no routing to change
            flags.append(ProviderFlag(
                name, "; ".join(reasons) + ": another model, template or tokenizer on this server?", "",
                toml_list("exclude_providers", [*exclude, name] if name not in exclude else exclude),
                "serve the same model, chat template and tokenizer on it as on the others, or remove it from "
                "[api] base_url"))
        elif reasons:
            slug = routing_name(name)
            flags.append(ProviderFlag(
                name, "; ".join(reasons) + ": another quantization or tokenizer?",
                toml_list("ignore", [*ignore, slug] if slug not in ignore else ignore),
                toml_list("exclude_providers", [*exclude, name] if name not in exclude else exclude)))
    if min_exact_share is not None:
        relative = {f.provider for f in flags}
        flags += [f for f in flag_sources(providers, min_answers=min_answers, min_exact_share=min_exact_share,
                                          exclude=exclude) if f.provider not in relative]
    return flags
