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
                     which is the same thing); for the server's own ids: they decode at all
    text_matches_ids the server's ids decode to the stored text: else its reasoning or tool parser
                     rewrote the text after generating it (kimi_k2's stripped reasoning whitespace).
                     The ids are what the model generated: a measure, never a reason to drop them
    token_count      |span tokens - billed completion_tokens| <= tolerance (the exact diff is kept)
    matches_backend  the server's own completion ids equal the reconstruction, id for id
    matches_backend_prompt  the server's own prompt ids (`prompt_token_ids`) equal the rendered prompt
                     (the template's render through the generation prompt), id for id
    tool_call_ids    an answer that calls tools, rendered from its text (no server ids): every call's
                     `id` has the shape the model itself writes, `functions.{name}:{index}` with the
                     call's own function name. A provider that rewrites it (`call_…`) or drops it
                     hands back another text than the model generated, so the rendered ids are not
                     the model's (core/tokens/policy.py drops the sample unless told to keep it)

Beside the checks, the prompt: its token count (everything before the answer span, the generation
prompt's `<think>` included) against the provider's `usage.prompt_tokens`, kept as `prompt_diff`.
It is not a check of the answer, so it does not make a sample invalid; the report counts the
disagreements (`prompt_token_count`) per provider, and core/tokens/policy.py decides what a sample's
checks and differences mean for merge (a BPE split keeps it, a leaked `<think>` drops it).

A turn of a multi-turn conversation (a record with `turn`, core/records.py) reconstructs the same way:
its messages hold the target's own earlier answers, which the template renders as history (Kimi-K2.5:
`<think></think>{content}`, their reasoning dropped; reasoning keys on those messages render only
inside a tool-call loop), and the loss mask covers this turn's answer only. Where those earlier
answers sit (`history_spans`) is kept in the index, so a merge writing one sample per conversation
can mask them too (core/merge/merge.py); the report counts the prompt check per turn number.

The loss mask is 1 from the `<think>` after the last assistant header through its `<|im_end|>`
(SpecForge's kimi-k2 convention), 0 elsewhere. Truncated answers (finish_reason "length") have no
end-of-turn token in reality, so none is rendered: they fail `ends_with_eot` by design and are never
clean. Where the backend returned completion ids, those ids are the span and the reconstruction is
only compared with them.

Where the backend returned its prompt ids and they differ, the sample's prompt is the server's (the
model was conditioned on those, so the hidden states must be too), and `prompt_tokens` counts them.
That is safe for the loss mask: it covers the answer span only, which starts where the prompt ends
whatever its length; the prompt's masked tail (the generation prompt's `<think>`) stays masked only
when the server's prompt ends with the same ids, else the mask starts at the answer. Ids outside the
tokenizer's vocabulary keep the rendered prompt, and the check fails.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from draftgen.core.errors import DraftgenError
from draftgen.core.records import answer_source
from draftgen.core.tokens.template import ChatTemplate, RenderedChat, Segment, TemplateError
from draftgen.core.tokens.tokenizer import Tokenizer

CHECKS = ("renders", "one_think_close", "no_think_open", "ends_with_eot", "round_trip", "token_count",
          "matches_backend", "matches_backend_prompt", "text_matches_ids", "tool_call_ids")
DEFAULT_COUNT_TOLERANCE = 2
SOURCES = ("reconstructed", "backend")
PROMPT_SOURCES = ("rendered", "backend")


# The sample's ids as the worker builds them: an `array` of unsigned 32-bit integers in the machine's order.
U32 = "I" if array("I").itemsize == 4 else "L"


@dataclass(slots=True, eq=False)  # one per answer in the workers: a frozen __init__ costs ~3x (setattr per field)
class Reconstruction:
    # The sample as built, no numpy array made for it (a token worker writes these buffers' bytes as they are:
    # numpy's per-call cost on ~150 ids is most of what making and dropping two arrays an answer costs);
    # `input_ids` and `loss_mask` are numpy views of them.
    ids: array                       # uint32 [T] (typecode U32)
    mask: bytearray                  # uint8 [T], 0/1
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
    prompt_source: str = "rendered"          # "backend": the prompt ids are the server's (PROMPT_SOURCES)
    turn: int | None = None                  # the turn number of a multi-turn record (`turn`), else None
    # Earlier assistant turns in the prompt: token ranges [start, end) from the `<think>` after their
    # header through their end-of-turn token (RenderedChat.history_turns); () when the prompt holds
    # none, or is the server's and differs from the rendering (the positions are not known then).
    history_spans: tuple[tuple[int, int], ...] = ()
    tool_calls: int = 0                      # calls in the answer (tool_call_ids applies when > 0)

    @property
    def input_ids(self) -> np.ndarray:
        """uint32 [T]: the sample's ids (a view of `ids`)."""
        return np.frombuffer(self.ids, dtype=np.uint32)

    @property
    def loss_mask(self) -> np.ndarray:
        """uint8 [T], 0/1 (a view of `mask`)."""
        return np.frombuffer(self.mask, dtype=np.uint8)

    @property
    def valid(self) -> bool:
        return not self.failed_checks

    def index_meta(self) -> dict[str, Any]:
        """The metadata of this sample's `tokens/index.jsonl` line (documented in core/records.py)."""
        meta = {"answer_start": self.answer_start, "answer_end": self.answer_end, "valid": not self.failed_checks,
                "failed_checks": list(self.failed_checks), "span_tokens": self.span_tokens,
                "billed_tokens": self.billed_tokens, "count_diff": self.count_diff,
                "truncated": self.truncated, "source": self.source, "prompt_tokens": self.prompt_tokens,
                "billed_prompt_tokens": self.billed_prompt_tokens, "prompt_diff": self.prompt_diff,
                "provider": self.provider, "prompt_source": self.prompt_source}
        # The optional keys only where set, in this order (a worker makes one of these an answer: no dict for
        # the keys left out)
        if self.turn is not None:
            meta["turn"] = self.turn
        if self.tool_calls:
            meta["tool_calls"] = self.tool_calls
        if self.history_spans:
            meta["history_spans"] = [list(s) for s in self.history_spans]
        return meta

    @property
    def prompt_diff(self) -> int | None:
        """Reconstructed prompt tokens - usage.prompt_tokens (None when either is unknown)."""
        if self.prompt_tokens is None or self.billed_prompt_tokens is None:
            return None
        return self.prompt_tokens - self.billed_prompt_tokens


# The prompt texts a token worker remembers the ids of (PromptTexts): texts of at least PROMPT_TEXT_MIN characters
# (shorter ones cost less to encode than to remember; the tokenizer keeps its own very short ones), up to
# PROMPT_TEXT_CHARS characters in all, the least recently used forgotten first. About 4 MB a worker when full
# (the texts, 2 bytes a character where one is not Latin-1, their ids at 4 bytes a token, the table: 8.2 MB
# measured at 2M characters of bench_engine's answers).
PROMPT_TEXT_MIN = 64
PROMPT_TEXT_CHARS = 1 << 20


class PromptTexts:
    """The ids of the prompt texts a token worker encoded last, by their text: a system prompt sent with every
    request, a tool declaration, a multi-turn conversation's earlier turns (each turn's prompt holds them all
    again) are encoded once while they keep coming back, not with each answer. The same ids as encoding
    them again (a tokenizer's ids depend on the text only). Bounded: `max_chars` characters of text in all
    (a text longer than that is encoded and not kept)."""

    def __init__(self, tok: Tokenizer, max_chars: int = PROMPT_TEXT_CHARS) -> None:
        self.tok = tok
        self.max_chars = max_chars
        self.chars = 0  # the characters of the texts kept
        self._ids: dict[str, array] = {}  # oldest first: a text used again is moved to the end

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, text: str) -> bool:
        return text in self._ids

    def encode(self, text: str) -> Sequence[int]:
        """`tok.encode_text(text)`, remembered."""
        n = len(text)
        if n < PROMPT_TEXT_MIN:
            return self.tok.encode_text(text)
        ids = self._ids.pop(text, None)
        if ids is None:
            ids = array(U32, self.tok.encode_text(text))
            if n > self.max_chars:
                return ids
            self.chars += n
            while self.chars > self.max_chars:
                oldest = next(iter(self._ids))
                self.chars -= len(oldest)
                del self._ids[oldest]
        self._ids[text] = ids
        return ids


def encode_segments(tok: Tokenizer, segments: Iterable[Segment], starts: list[int] | None = None,
                    texts: PromptTexts | None = None) -> list[int]:
    """The ids of `segments`; `starts`, when given, gets the position each segment starts at (and the end).
    `texts`: the ids of texts encoded before (a worker's, for a prompt's texts)."""
    ids: list[int] = []
    special_id = tok.special_id  # bound once: a dozen segments an answer
    encode_text = texts.encode if texts is not None else tok.encode_text
    for text, special, known in segments:
        if starts is not None:
            starts.append(len(ids))
        if known:  # a template's fixed piece, encoded when the template was loaded (Segment.ids)
            ids += known
        elif special:
            ids.append(special_id(text))
        elif text:
            ids += encode_text(text)
    if starts is not None:
        starts.append(len(ids))
    return ids


def unrenderable(error: str, *, billed_tokens: int | None = None, truncated: bool = False,
                 source: str = "reconstructed", provider: str | None = None) -> Reconstruction:
    """The outcome of an answer whose conversation could not be rendered: no tokens, `renders` failed."""
    checks = {"renders": False}
    return Reconstruction(array(U32), bytearray(), 0, 0, checks, _finish(checks), 0, None,
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
    if False not in checks.values():  # most answers: nothing to name
        return ()
    return tuple(name for name in CHECKS if checks.get(name) is False)


def _decoded(tok: Tokenizer, span: list[int]) -> str | None:
    """The text of `span`, or None for ids that do not decode."""
    try:
        return tok.decode(span)
    except Exception:  # a tokenizer's own error type
        return None


def _check_think_tags(checks: dict[str, bool], tok: Tokenizer, rendered: RenderedChat,
                      span: np.ndarray | list[int], text: str, special_ids: list[int] | None = None) -> None:
    """`one_think_close` and `no_think_open`, for templates with thinking tags: the answer closes its
    thinking exactly once and never opens it (beyond the `<think>` a template leaves to the model).
    `span` is the answer's ids: a list where `special_ids` are given, else a numpy view of the sample's ids.
    The tags are counted among `special_ids` when given: every id of the span that can be a special token's
    (`_answer_special_ids`, our own ids). Otherwise one numpy pass keeps the span's ids from the lower tag's
    up, a handful, and they are counted among those (two `list.count`s over the whole span cost as much at
    130 tokens, and 35x that at 2,000, where an answer with its reasoning often is)."""
    close_tag, open_tag = rendered.think_close, rendered.think_open
    if close_tag is None and open_tag is None:
        return
    close_id = tok.special_id(close_tag) if close_tag is not None else -1  # -1: the template has no such tag
    open_id = tok.special_id(open_tag) if open_tag is not None else -1
    if special_ids is None:
        ids = np.asarray(span)  # the view it is given then, as it is
        special_ids = ids[ids >= min(i for i in (close_id, open_id) if i >= 0)].tolist()
    if close_tag is not None:
        checks["one_think_close"] = special_ids.count(close_id) == 1 and text.count(close_tag) == 1
    if open_tag is not None:
        body_text, opened, opens = text, True, special_ids.count(open_id)
        if rendered.answer_opens_think:  # templates whose generation prompt leaves `<think>` to the model
            opened = len(span) > 0 and int(span[0]) == open_id
            body_text, opens = text.removeprefix(open_tag), opens - opened  # the span after it
        checks["no_think_open"] = opened and not opens and open_tag not in body_text


def _answer_special_ids(tok: Tokenizer, answer: Iterable[Segment]) -> list[int]:
    """The ids of the answer's special pieces (a fixed piece's all of them): for a tokenizer whose text ids
    are never a special token's (`text_ids_plain`), every special id of the answer span `encode_segments`
    makes of `answer`, so the think tags are counted there rather than by a pass over the span (~1.5 us an
    answer of bench_engine's, its numpy compare, selection and list)."""
    ids: list[int] = []
    for text, special, known in answer:
        if known:
            ids += known
        elif special:
            ids.append(tok.special_id(text))
    return ids


def model_call_id(call: Any) -> bool:
    """Whether a tool call's `id` has the shape Kimi-K2 generates: `functions.{name}:{index}`, `name`
    the call's own function name (vLLM's and SGLang's kimi_k2 tool parsers read it back that way)."""
    if not isinstance(call, Mapping):
        return False
    fn = call.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    call_id = call.get("id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        return False
    prefix = f"functions.{name}:"
    return call_id.startswith(prefix) and call_id[len(prefix):].isascii() and call_id[len(prefix):].isdigit()


def reconstruct(tok: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]], reasoning: str | None,
                content: str | None, *, billed_tokens: int | None = None, backend_ids: Sequence[int] | None = None,
                truncated: bool = False, tool_calls: list[dict[str, Any]] | None = None,
                count_tolerance: int = DEFAULT_COUNT_TOLERANCE, verify_decode: bool = False,
                billed_prompt_tokens: int | None = None, provider: str | None = None,
                backend_prompt_ids: Sequence[int] | None = None, turn: int | None = None,
                tools: list[Any] | None = None, texts: PromptTexts | None = None) -> Reconstruction:
    """Token ids, loss mask and validation of one answer to `messages`.

    `verify_decode`: decode the span for `round_trip` even where the tokenizer is known lossless.
    `billed_prompt_tokens`: the provider's `usage.prompt_tokens`, compared with the rendered prompt.
    `backend_prompt_ids`: the server's own prompt ids, compared with the rendered prompt (and used).
    `turn`: the turn number of a multi-turn record, kept for the per-turn figures.
    `tools`: the function schemas the request sent (the template declares them before the messages).
    `texts`: the ids of prompt texts encoded before (a token worker's PromptTexts).
    """
    source = "backend" if backend_ids is not None else "reconstructed"
    billed = int(billed_tokens) if billed_tokens is not None else None
    try:
        loaded_for = getattr(template, "tok", None)
        if loaded_for is not None and loaded_for is not tok:  # its fixed pieces' ids are another tokenizer's
            raise TemplateError(f"the {template.name} template was loaded for tokenizer {loaded_for.name}, "
                                f"not {tok.name}")
        rendered = template.render(messages, reasoning, content or "", truncated=truncated, tool_calls=tool_calls,
                                   tools=tools)
        starts: list[int] | None = [] if rendered.history_turns else None
        prompt_ids = encode_segments(tok, rendered.prompt, starts, texts)
        answer_ids = encode_segments(tok, rendered.answer)
        suffix_ids = encode_segments(tok, rendered.suffix)
        eot_id = tok.special_id(rendered.eot)
    except DraftgenError as e:
        return unrenderable(str(e), billed_tokens=billed, truncated=truncated, source=source, provider=provider)

    vocab = tok.vocab_size
    mask_tail = rendered.mask_prompt_tail
    prompt_source, prompt_match = "rendered", None
    history = tuple((starts[a], starts[b]) for a, b in rendered.history_turns) if starts else ()
    if backend_prompt_ids is not None:
        server_prompt = [int(i) for i in backend_prompt_ids]
        prompt_match = server_prompt == prompt_ids
        if prompt_match:
            prompt_source = "backend"
        elif all(0 <= i < vocab for i in server_prompt):
            # The tail keeps its mask only where the server ran the same generation prompt.
            if mask_tail and server_prompt[-mask_tail:] != prompt_ids[-mask_tail:]:
                mask_tail = 0
            prompt_ids, prompt_source = server_prompt, "backend"
            history = ()  # where the server's turns sit is not known

    span = answer_ids
    backend_usable = False
    if backend_ids is not None:
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
        decoded = _decoded(tok, span)
        text = decoded or ""
        # The server's ids are the sample: their text is checked against them (text_matches_ids), and
        # only ids that do not decode at all fail the round trip.
        round_trip = decoded is not None and (span is not answer_ids or decoded == answer_text)
    # One uint32 buffer for the whole sample, filled in place (no list of the whole sample made first).
    buffer = array(U32, prompt_ids)
    buffer.fromlist(span)
    buffer.fromlist(suffix_ids)
    start = len(prompt_ids)
    end = start + len(span)

    checks: dict[str, bool] = {"renders": True}
    # Our own ids from a tokenizer whose text ids are never special: the span's special ids are its pieces'.
    own = span is answer_ids and getattr(tok, "text_ids_plain", False)
    _check_think_tags(checks, tok, rendered, span if own else np.frombuffer(buffer, dtype=np.uint32)[start:end], text,
                      _answer_special_ids(tok, rendered.answer) if own else None)
    checks["ends_with_eot"] = len(span) > 0 and span[-1] == eot_id
    checks["round_trip"] = round_trip
    count_diff = None
    if billed is not None:
        count_diff = len(span) - billed
        checks["token_count"] = abs(count_diff) <= count_tolerance
    if backend_ids is not None:
        checks["matches_backend"] = backend_usable and span == answer_ids
        source = "backend" if backend_usable else "reconstructed"
        if backend_usable and round_trip:
            checks["text_matches_ids"] = text == answer_text
    if prompt_match is not None:
        checks["matches_backend_prompt"] = prompt_match
    if tool_calls and span is answer_ids:
        # Rendered from the stored calls: their ids are in the span, so they must be the model's own.
        checks["tool_call_ids"] = all(model_call_id(c) for c in tool_calls)

    # 1 over [start - mask_tail, end), a Python slice of the sample as numpy's `mask[a:b] = 1` took it
    length = len(buffer)
    loss_mask = bytearray(length)
    loss_mask[start - mask_tail:end] = b"\x01" * len(range(length)[start - mask_tail:end])
    billed_prompt = int(billed_prompt_tokens) if billed_prompt_tokens else None  # 0: not reported
    return Reconstruction(buffer, loss_mask, start, end, checks, _finish(checks), len(span), count_diff,
                          source, billed, truncated, prompt_tokens=start, billed_prompt_tokens=billed_prompt,
                          provider=provider, prompt_source=prompt_source, turn=turn, history_spans=history,
                          tool_calls=len(tool_calls or ()))


# The fields of a response line (core/records.py) that reconstruction reads, in the order `answer_fields`
# gives their values: what crosses to a token worker for each answer, as a tuple (no dict an answer for the
# main process to make and pickle, or for the worker to read back).
ANSWER_FIELDS = ("id", "messages", "reasoning", "content", "tool_calls", "finish_reason", "truncated", "token_ids",
                 "prompt_token_ids", "turn", "tools")
Answer = tuple[Any, ...]  # answer_fields' values


def answer_fields(record: Mapping[str, Any]) -> Answer:
    """What reconstruction reads of a response line: the values of its ANSWER_FIELDS (None where missing),
    whom it is tallied under (`answer_source`), then its usage's completion_tokens and prompt_tokens (None
    where not given)."""
    usage = record.get("usage")
    if isinstance(usage, dict):
        return (*map(record.get, ANSWER_FIELDS), answer_source(record), usage.get("completion_tokens"),
                usage.get("prompt_tokens"))
    return (*map(record.get, ANSWER_FIELDS), answer_source(record), None, None)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reconstruct_record(tok: Tokenizer, template: ChatTemplate, record: Mapping[str, Any], *,
                       count_tolerance: int = DEFAULT_COUNT_TOLERANCE) -> Reconstruction:
    """`reconstruct` of one responses.jsonl line (fields documented in core/records.py)."""
    return reconstruct_answer(tok, template, answer_fields(record), count_tolerance=count_tolerance)


def reconstruct_answer(tok: Tokenizer, template: ChatTemplate, answer: Answer, *,
                       count_tolerance: int = DEFAULT_COUNT_TOLERANCE, texts: PromptTexts | None = None
                       ) -> Reconstruction:
    """`reconstruct_record` of a line's `answer_fields` (what a token worker is sent); `texts`: the worker's
    PromptTexts."""
    (_, messages, reasoning, content, tool_calls, finish_reason, truncated, backend, backend_prompt, turn, tools,
     provider, billed, billed_prompt) = answer
    truncated = bool(truncated) or finish_reason == "length"
    billed, billed_prompt, turn = _count(billed), _count(billed_prompt), _count(turn)
    if tools is not None and not isinstance(tools, list):
        return unrenderable(f"tools must be a list of function schemas, not {type(tools).__name__}",
                            billed_tokens=billed, truncated=truncated, provider=provider)
    if tool_calls is not None and not isinstance(tool_calls, list):
        return unrenderable(f"tool_calls must be a list, not {type(tool_calls).__name__}",
                            billed_tokens=billed, truncated=truncated, provider=provider)
    for name, value in (("reasoning", reasoning), ("content", content)):
        if value is not None and not isinstance(value, str):
            return unrenderable(f"{name} must be a string, not {type(value).__name__}", billed_tokens=billed,
                                truncated=truncated, provider=provider)
    if backend is not None and not (isinstance(backend, list) and all(isinstance(i, int) for i in backend)):
        return unrenderable("token_ids must be a list of integers", billed_tokens=billed, truncated=truncated,
                            source="backend", provider=provider)
    if backend_prompt is not None and not (isinstance(backend_prompt, list)
                                           and all(isinstance(i, int) for i in backend_prompt)):
        return unrenderable("prompt_token_ids must be a list of integers", billed_tokens=billed,
                            truncated=truncated, provider=provider)
    return reconstruct(tok, template, messages if isinstance(messages, list) else [], reasoning, content or "",
                       billed_tokens=billed, backend_ids=backend, truncated=truncated,
                       tool_calls=tool_calls or None, count_tolerance=count_tolerance,
                       billed_prompt_tokens=billed_prompt, provider=provider, backend_prompt_ids=backend_prompt,
                       turn=turn, tools=tools or None, texts=texts)
