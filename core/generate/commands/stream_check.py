"""Which mode keeps a self-hosted server's text as generated: the smoke test's `stream` row.

A server's reasoning parser may rewrite the text of a whole (non-streamed) answer and not the
streamed deltas: transformers serve 5.24 strips the reasoning and the content of a non-streamed
answer (`utils/chat_parsing/content_parsers.py`, `_text`: `text.strip()` unless `strip` is false),
while its streamed deltas pass as generated. Text rewritten so is not what the model generated, and
the ids reconstructed from it are not the model's.

The smoke test sends one request both ways and compares the texts (`mode_verdict`):
- greedy and seeded first (`stream_pair`); when that answer is empty on both sides (a model that
  ends its turn at once) nothing would be compared, so a sampled, seeded request follows
  (`SAMPLED_TEMPERATURE`, each of `SAMPLED_SEEDS` in turn, one after the other so a server with one
  random generator draws the same) until one has text; none with text is a warning, never a pass;
- the streamed copy never carries a key streaming refuses (`STREAM_REFUSED_KEYS`);
- texts that differ only in whitespace at their edges name the server's parser ("strips leading
  whitespace … in non-streamed answers"), and the side with less whitespace is the rewritten one (a
  parser strips, it does not add); a greedy answer that differs otherwise is the non-streamed one
  rewritten; sampled answers that differ otherwise say only that the server may not honour `seed`.

The mode that keeps the text is the verdict's `decided`: with `[api] stream` unset the run uses it
(the smoke test records it in smoke.json, core/generate/loop/smoke_record.py); set to the other
mode, the row fails with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftgen.core.bodies import ChatBody, any_keys

# SGLang 0.5.17+ answers 400 to `return_token_ids` in a streamed request.
STREAM_REFUSED_KEYS = ("return_token_ids",)
SAMPLED_TEMPERATURE = 1.0
SAMPLED_SEEDS = (1, 2, 3)
PARTS = ("reasoning", "content")


def stream_pair(body: ChatBody, *, temperature: float = 0, seed: int = 0) -> tuple[ChatBody, ChatBody]:
    """`body` streamed and not, with the same `temperature` and `seed` (greedy by default), so a server
    answers both with the same ids; the streamed copy without the keys streaming refuses."""
    base = body.copy()
    base.pop("stream", None)
    base.pop("stream_options", None)
    base["temperature"] = temperature
    base["seed"] = seed
    streamed = base.copy()
    for key in STREAM_REFUSED_KEYS:
        any_keys(streamed).pop(key, None)
    streamed["stream"] = True
    streamed["stream_options"] = {"include_usage": True}
    return streamed, base


def _parts(a: Any) -> dict[str, str]:
    return {"reasoning": a.reasoning or "", "content": a.content or ""}


def has_text(a: Any) -> bool:
    """The answer holds something beyond whitespace (in its reasoning or its content)."""
    return any(text.strip() for text in _parts(a).values())


@dataclass(frozen=True)
class Difference:
    part: str        # "reasoning" or "content"
    edges: bool      # only the whitespace at the edges differs
    where: str       # "leading", "trailing" or "leading and trailing" (edges only)
    stripped: str    # the side with less whitespace: "non-streamed" or "streamed" (edges only)


def differences(streamed: Any, plain: Any) -> list[Difference]:
    """Each part whose streamed and non-streamed texts differ, and how."""
    out = []
    s_parts, p_parts = _parts(streamed), _parts(plain)
    for part in PARTS:
        s, p = s_parts[part], p_parts[part]
        if s == p:
            continue
        if s.strip() != p.strip():
            out.append(Difference(part, False, "", ""))
            continue
        lead = len(s) - len(s.lstrip()) != len(p) - len(p.lstrip())
        trail = len(s) - len(s.rstrip()) != len(p) - len(p.rstrip())
        where = "leading and trailing" if lead and trail else "leading" if lead else "trailing"
        out.append(Difference(part, True, where, "non-streamed" if len(p) < len(s) else "streamed"))
    return out


@dataclass(frozen=True)
class ModeVerdict:
    passed: bool
    detail: str
    warning: bool = False
    decided: bool | None = None  # the mode that keeps the text (True: streamed); None: not known
    parser: str = ""             # the cause and fix when the run's mode rewrites text (for the tokens row)


def shown(how: str, streamed: Any, plain: Any) -> str:
    s, p = _parts(streamed), _parts(plain)
    return (f"{how} streamed vs not: reasoning {s['reasoning'][:40]!r} vs {p['reasoning'][:40]!r}, "
            f"content {s['content'][:40]!r} vs {p['content'][:40]!r}")


def _cause(diffs: list[Difference], rewritten: str) -> str:
    edges = [d for d in diffs if d.edges]
    if not edges or len(edges) < len(diffs):
        return f"the server rewrites the text of {rewritten} answers (a reasoning parser)"
    where = sorted({d.where for d in edges}, key=len)[-1]
    parts = " and ".join(f"the {d.part}" for d in edges)
    kind = "reasoning parser" if any(d.part == "reasoning" for d in edges) else "parser"
    return f"the server's {kind} strips {where} whitespace of {parts} in {rewritten} answers"


def mode_verdict(stream: bool | None, streamed: Any, plain: Any, how: str, *, sampled: bool = False) -> ModeVerdict:
    """The `stream` row from two answers with text (`stream`: `[api] stream` as set, None when unset)."""
    diffs = differences(streamed, plain)
    seen = shown(how, streamed, plain)
    if not diffs:
        return ModeVerdict(True, f"streamed and non-streamed text equal ({seen})", decided=stream or False)
    if sampled and not all(d.edges for d in diffs):
        return ModeVerdict(True, f"could not compare ({seen}): the sampled answers differ beyond whitespace at their "
                           "edges (does the server honour `seed`?); the run keeps the configured mode ([api] stream)",
                           warning=True)
    keeps_streamed = not any(d.edges and d.stripped == "streamed" for d in diffs)
    rewritten = "non-streamed" if keeps_streamed else "streamed"
    cause = _cause(diffs, rewritten)
    mode = "true" if keeps_streamed else "false"
    if plain.token_ids and keeps_streamed:  # the server's ids are the sample's: the text alone is rewritten
        return ModeVerdict(True, f"{seen}: {cause}; the server's token ids are the samples' ids", warning=True,
                           parser=f"{cause}: use stream = true for the text as generated")
    if stream is None:
        return ModeVerdict(True, f"{seen}: {cause}, so this run {'streams' if keeps_streamed else 'does not stream'} "
                           "(recorded in smoke.json for `run`; [api] stream overrides it)", decided=keeps_streamed)
    if stream == keeps_streamed:
        return ModeVerdict(True, f"{seen}: {cause}; this run {'streams' if stream else 'does not stream'}, so it "
                           "keeps the text as generated", warning=True, decided=keeps_streamed)
    return ModeVerdict(False, f"{seen}: {cause}, so their ids would not be the model's: set [api] stream = {mode} "
                       "(or remove the line: the smoke test then picks the mode)", decided=keeps_streamed,
                       parser=f"{cause}: use stream = {mode}")


def not_compared(tried: int) -> ModeVerdict:
    """Every comparison answer came back empty on both sides: a warning, never a pass."""
    return ModeVerdict(True, f"could not compare: the greedy answer and {tried} sampled, seeded one(s) (temperature "
                       f"{SAMPLED_TEMPERATURE}) came back empty on both sides; the run keeps the configured mode "
                       "([api] stream)", warning=True)
