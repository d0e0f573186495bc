"""The answer pool: canned answers tokenized once at startup, so no request ever tokenizes.

An answer's completion is `{reasoning}</think>{content}<|im_end|>` as the Kimi tokenizer counts
it: ordinary-text tokens of the reasoning, the `</think>` special token, ordinary-text tokens of
the content, the `<|im_end|>` special token. That count is what `usage.completion_tokens` bills.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from itertools import accumulate

from draftgen.simulator.answer_text import STYLES, content_text, reasoning_text

# Characters per token of the canned text under the Kimi tokenizer (measured), used only to aim
# the generated length near the drawn token count; the real count comes from tokenizing.
_CHARS_PER_TOKEN = 3.4


@dataclass(frozen=True)
class AnswerTokenizer:
    """The three operations the pool needs from the Kimi tokenizer."""

    encode_text: Callable[[str], list[int]]  # ordinary text: special-token strings stay text
    special_id: Callable[[str], int]
    token_bytes: Callable[[int], bytes]


@functools.cache
def _bundled_encoding():  # -> tiktoken.Encoding
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    folder = resources.files("draftgen.core") / "data" / "kimi-k2"
    table = json.loads((folder / "special_tokens.json").read_text())
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    base = table["base_vocab_size"]
    special = {f"<|reserved_token_{i}|>": i for i in range(base, table["model_vocab_size"])}
    for name, idx in table["named"].items():
        special.pop(f"<|reserved_token_{idx}|>", None)
        special[name] = idx
    return tiktoken.Encoding(name="kimi-k2-sim", pat_str="|".join(table["pat_str_alternatives"]),
                             mergeable_ranks=ranks, special_tokens=special)


@functools.cache
def answer_tokenizer() -> AnswerTokenizer:
    """The Kimi tokenizer answers are counted with: the project's bundled one, or, where that
    module is missing, one built here from the same bundled files (so the same ids)."""
    try:
        from draftgen.core.tokens.tokenizer import bundled_kimi
    except ImportError:
        enc = _bundled_encoding()
        return AnswerTokenizer(enc.encode_ordinary, enc._special_tokens.__getitem__,
                               enc.decode_single_token_bytes)
    tok = bundled_kimi()
    encoding = getattr(tok, "encoding", None) or _bundled_encoding()
    return AnswerTokenizer(tok.encode_text, tok.special_id, encoding.decode_single_token_bytes)


@dataclass(frozen=True, slots=True, eq=False)  # identity hash: cheap as a cache key
class Answer:
    """One canned answer with its token ids and, per token, where its bytes end in the text."""

    style: str
    reasoning: str
    content: str
    reasoning_bytes: bytes
    content_bytes: bytes
    reasoning_ids: tuple[int, ...]
    content_ids: tuple[int, ...]
    reasoning_ends: tuple[int, ...]  # byte offset in reasoning_bytes after each token
    content_ends: tuple[int, ...]

    @property
    def completion_tokens(self) -> int:
        return len(self.reasoning_ids) + 1 + len(self.content_ids) + 1


@dataclass(frozen=True, slots=True)
class Completion:
    """What one request generated: an answer, without reasoning when thinking is off, and cut
    at max_tokens when it does not fit. `reasoning` and `content` are exactly the decoding of
    the ordinary-text tokens among `ids`."""

    answer: Answer
    think: bool  # the answer's reasoning tokens are part of it
    n_reasoning: int  # reasoning tokens generated
    think_end: bool  # `</think>` generated
    n_content: int  # content tokens generated
    im_end: bool  # `<|im_end|>` generated: the answer stopped by itself
    reasoning: str
    content: str
    finish_reason: str  # "stop" or "length"
    think_end_id: int
    im_end_id: int

    @property
    def completion_tokens(self) -> int:
        return self.n_reasoning + self.think_end + self.n_content + self.im_end

    @property
    def ids(self) -> list[int]:
        """Every generated token, specials included (built on demand: most requests never ask)."""
        a = self.answer
        ids = list(a.reasoning_ids[: self.n_reasoning])
        if self.think_end:
            ids.append(self.think_end_id)
            ids.extend(a.content_ids[: self.n_content])
        if self.im_end:
            ids.append(self.im_end_id)
        return ids


@dataclass(frozen=True)
class AnswerPool:
    by_style: dict[str, tuple[Answer, ...]]
    think_end_id: int
    im_end_id: int

    def pick(self, style: str, draw: int) -> Answer:
        answers = self.by_style.get(style) or next(iter(self.by_style.values()))
        return answers[draw % len(answers)]

    def complete(self, a: Answer, max_tokens: int | None, think: bool = True) -> Completion:
        """`a` as generated under `max_tokens`: whole ("stop") or cut ("length").

        A cut falls on a token boundary, stepped back where it would split a UTF-8 character."""
        te, ie = self.think_end_id, self.im_end_id
        n_r = len(a.reasoning_ids) if think else 0
        reasoning = a.reasoning if think else ""
        if max_tokens is None or n_r + len(a.content_ids) + 2 <= max_tokens:
            return Completion(a, think, n_r, True, len(a.content_ids), True, reasoning, a.content, "stop", te, ie)
        if max_tokens <= n_r:
            k = _valid_cut(a.reasoning_bytes, a.reasoning_ends, max_tokens)
            return Completion(a, think, k, False, 0, False, _prefix(a.reasoning_bytes, a.reasoning_ends, k),
                              "", "length", te, ie)
        j = _valid_cut(a.content_bytes, a.content_ends, max_tokens - n_r - 1)
        return Completion(a, think, n_r, True, j, False, reasoning,
                          _prefix(a.content_bytes, a.content_ends, j), "length", te, ie)


def _prefix(raw: bytes, ends: tuple[int, ...], k: int) -> str:
    return raw[: ends[k - 1]].decode() if k > 0 else ""


def _valid_cut(raw: bytes, ends: tuple[int, ...], k: int) -> int:
    while k > 0:
        try:
            raw[: ends[k - 1]].decode()
            return k
        except UnicodeDecodeError:
            k -= 1
    return 0


def _tokenized(tok: AnswerTokenizer, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ids = tok.encode_text(text)
    ends = tuple(accumulate(len(tok.token_bytes(i)) for i in ids))
    if (ends[-1] if ends else 0) != len(text.encode()):
        raise RuntimeError("simulator answer pool: token bytes do not add up to the text")
    return tuple(ids), ends


@functools.lru_cache(maxsize=8)
def build_pool(seed: int, mean_tokens: int, sigma: float, size: int) -> AnswerPool:
    """`size` answers (split across the styles) with log-normal lengths of mean `mean_tokens`.

    Cached: tests start many servers with the same settings and share one pool."""
    tok = answer_tokenizer()
    rng = random.Random(f"draftgen-sim-pool:{seed}")
    mu = math.log(mean_tokens) - sigma * sigma / 2  # so that E[length] == mean_tokens
    by_style: dict[str, list[Answer]] = {s: [] for s in STYLES}
    for i in range(size):
        style = STYLES[i % len(STYLES)]
        total = max(8, min(int(rng.lognormvariate(mu, sigma)), 12 * mean_tokens))
        share = rng.uniform(0.45, 0.85)  # of the tokens spent reasoning
        r_text = reasoning_text(rng, style, int(total * share * _CHARS_PER_TOKEN))
        c_text = content_text(rng, style, int(total * (1 - share) * _CHARS_PER_TOKEN))
        r_ids, r_ends = _tokenized(tok, r_text)
        c_ids, c_ends = _tokenized(tok, c_text)
        by_style[style].append(Answer(style, r_text, c_text, r_text.encode(), c_text.encode(),
                                      r_ids, c_ids, r_ends, c_ends))
    return AnswerPool({s: tuple(a) for s, a in by_style.items() if a},
                      tok.special_id("</think>"), tok.special_id("<|im_end|>"))
