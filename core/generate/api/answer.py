"""What an answer's body says: a `ChatAnswer` parsed from a non-streamed completion (`parse_completion`),
or an SSE stream's chunks joined into the same shape first (`StreamState`, fed by the client's reader,
core/generate/api/client.py). The 200-with-a-problem cases (an error object, no choices, a finish
reason that ends no answer, a stream cut past the answer cap) are RequestFailed here; usage a server
sends is believed only when it is a count or a finite cost (`_usage_of`), and the token ids a
self-hosted server returns are read wherever its release puts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from draftgen.core.generate.api.classify import PastCap, RequestFailed
from draftgen.core.records import ErrorKind, Usage, arguments_text, reasoning_text
from draftgen.core.request_keys import TEXT_CHARS_PER_TOKEN, past_cap_limits
from draftgen.core.secrets import Redactor
from draftgen.core.servers import ServerProfile


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class ChatAnswer:
    content: str
    reasoning: str | None
    tool_calls: list[Any] | None
    finish_reason: str | None
    native_finish_reason: str | None
    provider: str | None
    model: str | None
    generation_id: str | None
    usage: Usage
    latency_s: float
    token_ids: list[int] | None = None
    priced: bool = True  # usage.cost was in the answer (false: billing.py estimates or looks it up)
    prompt_token_ids: list[int] | None = None  # the prompt ids the server ran (return_token_ids)
    # OpenRouter's structured reasoning, as returned (a stream's pieces joined, _Details): what a
    # later turn of the conversation passes back unmodified (core/generate/loop/conversations.py).
    reasoning_details: list[Any] | None = None
    doubt: str = ""  # what its usage said that is not believed (_usage_of): it is unpriced
    server: str | None = None  # the fleet's server that answered (api/fleet.py); None: one base_url


# The text-bearing keys of a reasoning detail, joined across stream chunks; others are taken as they come.
_DETAIL_TEXT = frozenset({"text", "summary", "data"})


class _Details:
    """A stream's `reasoning_details` deltas joined into whole details: a piece with the same `index` and
    `type` as the last detail continues it (its text keys' pieces kept in lists, joined once at the end;
    its other keys set). Runs once per reasoning chunk: no string is rebuilt per piece."""

    __slots__ = ("items", "texts", "key")

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.texts: list[dict[str, list[str]]] = []
        self.key: tuple[Any, Any] | None = None

    def feed(self, pieces: list[Any]) -> None:
        for piece in pieces:
            if type(piece) is not dict:
                continue
            key = (piece.get("index"), piece.get("type"))
            if key != self.key:
                self.key = key
                self.items.append(dict(piece))
                self.texts.append({k: [v] for k, v in piece.items() if k in _DETAIL_TEXT and type(v) is str})
                continue
            last, texts = self.items[-1], self.texts[-1]
            for k, v in piece.items():
                if k in _DETAIL_TEXT and type(v) is str:
                    if k in texts:
                        texts[k].append(v)
                    else:
                        texts[k] = [v]
                        last[k] = v
                elif v is not None:
                    last[k] = v

    def joined(self) -> list[dict[str, Any]]:
        for item, texts in zip(self.items, self.texts, strict=True):
            for k, parts in texts.items():
                item[k] = parts[0] if len(parts) == 1 else "".join(parts)
        return self.items


def _reasoning_of(message: dict[str, Any]) -> str | None:
    """Reasoning text: `reasoning`, else `reasoning_content`, else the text of `reasoning_details`."""
    return reasoning_text(message) or None


# What an answer's usage said that is not believed (ChatAnswer.doubt): billing.py books such an answer at
# its worst case or its generation record, and the run counts and says each kind once (request.py).
NEGATIVE_COST = "a negative usage.cost"
COST_NOT_A_NUMBER = "a usage.cost that is not a number"
BAD_COUNT = "token counts that are not counts"


_COUNT_END = 1 << 62  # a count past this is none (_count)


def _count(value: Any) -> int | None:
    """A token count as a server sends it: a non-negative integer, also written as an integral float
    (`12.0`) or a string of ASCII digits (`"12"`, as some proxies send numbers); None for anything else
    (negative, fractional, NaN, infinite, a boolean, null, missing, any other string)."""
    if type(value) is int:
        return value if 0 <= value < _COUNT_END else None
    if type(value) is float:
        return int(value) if value.is_integer() and 0 <= value < 2.0 ** 62 else None  # NaN, inf: not integral
    if type(value) is str and 0 < len(value) <= 18 and value.isascii() and value.isdigit():
        return int(value)
    return None


def _usage_of(raw: Any) -> tuple[Usage, bool, str]:
    """The answer's usage, whether it carried its cost (`usage.cost`, a finite non-negative JSON number):
    priced, and what in it is not believed ("" when nothing): a negative cost, a cost that is not a number
    (a string, a boolean, NaN, infinite), token counts that are not counts (`_count`). An answer with a
    doubt is unpriced, its counts kept only when they are counts (billing.py prices it at its worst case,
    or from its generation record)."""
    if not isinstance(raw, dict):
        return Usage(), False, ""
    get = raw.get  # once per answer: positional fields (prompt, completion, reasoning tokens, cost)
    cost, details = get("cost"), get("completion_tokens_details")
    # A count sent as a JSON integer (nearly all) is taken here; _count reads the other forms.
    prompt, completion = get("prompt_tokens"), get("completion_tokens")
    if not (type(prompt) is int and 0 <= prompt < _COUNT_END):
        prompt = _count(prompt)
    if not (type(completion) is int and 0 <= completion < _COUNT_END):
        completion = _count(completion)
    reasoning: int | None = 0
    if isinstance(details, dict):
        reasoning = details.get("reasoning_tokens")
        if not (type(reasoning) is int and 0 <= reasoning < _COUNT_END):
            reasoning = _count(reasoning)
    doubt = "" if prompt is not None and completion is not None else BAD_COUNT
    priced = False
    if cost is None:
        cost = 0.0
    elif (type(cost) is float or type(cost) is int) and 0 <= cost < math.inf:  # NaN compares false
        priced = not doubt
    else:
        doubt = NEGATIVE_COST if type(cost) in (int, float) and cost < 0 else COST_NOT_A_NUMBER
        cost = 0.0
    return Usage(prompt or 0, completion or 0, reasoning or 0, float(cost) if priced else 0.0), priced, doubt


def _error_message(err: Any) -> str:
    """The message of an `error` object inside a 200 (its first 300 characters)."""
    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return str(msg)[:300]


def _failure_meta(err: Any, provider: Any) -> dict[str, Any]:
    """The metadata of an error inside a 200: the error's own, naming the provider of the body (its
    `provider`) when it names none, as OpenRouter's error statuses do in `metadata.provider_name`."""
    meta = err.get("metadata") if isinstance(err, dict) else None
    meta = dict(meta) if isinstance(meta, dict) else {}
    if provider and isinstance(provider, str) and not meta.get("provider_name"):
        meta["provider_name"] = provider
    return meta


def _error_code(err: Any) -> Any:
    """The `code` of an error inside a 200 (RequestFailed keeps it when it is a status)."""
    return err.get("code") if isinstance(err, dict) else None


def _int_list(ids: Any) -> list[int] | None:
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    return None


# Where the servers put the ids (chat completions; core/servers.py says how each release is asked):
#   vLLM >= 0.10.2 (vllm/entrypoints/openai/protocol.py, later chat_completion/protocol.py): `token_ids`
#     on the choice (each stream chunk's choice carries its delta), `prompt_token_ids` at the top level
#     (ChatCompletionResponse; only the first stream chunk).
#   SGLang 0.5.17 (python/sglang/srt/entrypoints/openai/protocol.py): `prompt_token_ids` and `token_ids`
#     on the non-streamed choice; 0.5.18+ renamed the latter `response_token_ids`. From 0.5.20 the
#     `*_in_sglext` keys put them at the response level, streamed too: `sglext.input_ids` and
#     `sglext.output_ids` (one list per choice), in the stream's last chunks.
def _token_ids(obj: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
    """The generated ids a vLLM or SGLang server returns when asked: the choice's `token_ids` or
    `response_token_ids`, else SGLang's `sglext.output_ids` (one list per choice). None when absent or
    not a list of integers."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = choice.get("response_token_ids")
    if ids is None:
        ext = obj.get("sglext")
        out = ext.get("output_ids") if isinstance(ext, dict) else None
        ids = out[0] if isinstance(out, list) and out and isinstance(out[0], list) else None
    return _int_list(ids)


def _prompt_token_ids(obj: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
    """The prompt ids the server ran: the choice's `prompt_token_ids` (SGLang), else the response's
    (vLLM), else SGLang's `sglext.input_ids`. None when absent or not a list of integers."""
    ids = choice.get("prompt_token_ids")
    if ids is None:
        ids = obj.get("prompt_token_ids")
    if ids is None:
        ext = obj.get("sglext")
        ids = ext.get("input_ids") if isinstance(ext, dict) else None
    return _int_list(ids)


# The finish reasons of an answer (OpenAI's, which vLLM, SGLang and OpenRouter's normalised field
# use). Any other is no answer: SGLang's `abort` (an aborted request returned as a normal body),
# OpenRouter's `error` (with its error object). A missing one is taken as it comes.
ANSWER_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})


def _check_finish(obj: dict[str, Any], choice: dict[str, Any], server: ServerProfile | None) -> None:
    """RequestFailed for a finish reason that ends no answer (an attempt that failed, retried): "error", and
    "abort" (SGLang's aborted request); from a server whose kind says so (`odd_finish_fails`: a self-hosted
    one), any reason but the four that end an answer. OpenRouter's other reasons are a provider's own word
    passed through (e.g. "end_turn") on an answer it billed: kept, as before."""
    reason = choice.get("finish_reason")
    if reason is None or reason in ANSWER_FINISH_REASONS:
        return
    if reason == "error":
        raise RequestFailed(ErrorKind.FINISH_ERROR, f"finish_reason \"error\" ({choice.get('native_finish_reason')})",
                            metadata=_failure_meta(choice.get("error"), obj.get("provider")),
                            code=_error_code(choice.get("error")))
    if reason == "abort" or (server is not None and server.kind.odd_finish_fails):
        raise RequestFailed(ErrorKind.FINISH_ERROR, f"finish_reason {str(reason)[:40]!r}: the server ended the "
                            "request without an answer (SGLang: \"abort\"); retried, never stored")


def parse_completion(obj: Any, latency_s: float, server: ServerProfile | None = None) -> ChatAnswer:
    """An answer from a non-streamed body, or RequestFailed for the 200-with-a-problem cases (`server`: the
    run's profile, its kind asked only for a finish reason OpenRouter would keep, see _check_finish)."""
    # Once per answer: one lookup per key, the checks of the rare cases only when they apply.
    if not isinstance(obj, dict):
        raise RequestFailed(ErrorKind.BAD_BODY, "response body is not a JSON object")
    get = obj.get
    if get("error"):
        raise RequestFailed(ErrorKind.ERROR_IN_200, f"HTTP 200 with an error: {_error_message(obj['error'])}",
                            metadata=_failure_meta(obj["error"], get("provider")), code=_error_code(obj["error"]))
    choices = get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise RequestFailed(ErrorKind.EMPTY_CHOICES, "HTTP 200 with no choices")
    choice = choices[0]
    cget = choice.get
    reason = cget("finish_reason")
    if reason is not None and reason not in ANSWER_FINISH_REASONS:
        _check_finish(obj, choice, server)
    message = cget("message") or {}
    if not isinstance(message, dict):
        raise RequestFailed(ErrorKind.BAD_BODY, "choices[0].message is not an object")
    # Once per request: OpenRouter's `reasoning` read here, the other forms through the helper; the
    # server ids looked for only when a key that holds them is there.
    mget = message.get
    reasoning = mget("reasoning")
    if not (type(reasoning) is str and reasoning):
        reasoning = _reasoning_of(message)
    used, priced, doubt = _usage_of(get("usage"))
    token_ids = prompt_ids = None
    # A self-hosted server's ids, where _token_ids and _prompt_token_ids look (five `in`: a third of
    # frozenset.isdisjoint's cost, which walks every key of the dicts)
    if ("token_ids" in choice or "response_token_ids" in choice or "prompt_token_ids" in choice
            or "prompt_token_ids" in obj or "sglext" in obj):
        token_ids, prompt_ids = _token_ids(obj, choice), _prompt_token_ids(obj, choice)
    details = mget("reasoning_details")  # kept when it is a non-empty list
    return ChatAnswer(
        mget("content") or "", reasoning, mget("tool_calls") or None, reason, cget("native_finish_reason"),
        get("provider"), get("model"), get("id"), used, latency_s, token_ids, priced, prompt_ids,
        details if isinstance(details, list) and details else None, doubt)


def redacted_answer(a: ChatAnswer, redact: Redactor) -> ChatAnswer:
    """The answer with every field upstream names (not its text) redacted, in place (a field that is not
    a string, as a hostile upstream may send, is left as it is). Runs once per answer: the texts seen
    before (a provider, the model, "stop") are looked up in the redactor's memo without a call."""
    known = redact.known
    if type(v := a.provider) is str:
        a.provider = known.get(v) or redact(v)
    if type(v := a.model) is str:
        a.model = known.get(v) or redact(v)
    if type(v := a.generation_id) is str:
        a.generation_id = known.get(v) or redact(v)
    if type(v := a.finish_reason) is str:
        a.finish_reason = known.get(v) or redact(v)
    if type(v := a.native_finish_reason) is str:
        a.native_finish_reason = known.get(v) or redact(v)
    return a


class StreamState:
    """Accumulates SSE chunks into the same shape as a non-streamed body."""

    def __init__(self, cap: int = 0, details: bool = False) -> None:
        self.cap = cap  # the body's answer cap (0: none)
        self.token_limit, self.char_limit = past_cap_limits(cap)
        self.chars = 0  # answer text streamed (content, reasoning, tool arguments): the estimate without counts
        self.content: list[str] = []
        self.reasoning: list[str] = []
        # OpenRouter's structured reasoning, joined only when asked (`details`: a conversation's turn, whose
        # next turn passes it back); a single-turn request spends nothing on it.
        self.reasoning_details: _Details | None = _Details() if details else None
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.native_finish_reason: str | None = None
        self.meta: dict[str, Any] = {}
        self.usage: Any = None
        self.done = False
        self.choices = 0  # choice deltas seen: a stream of `choices: []` only carries no answer
        self.token_ids: list[int] | None = None  # vLLM's per-chunk `token_ids` deltas, joined
        self.sglext: dict[str, Any] | None = None
        self.prompt_token_ids: Any = None  # vLLM: top level, first chunk only

    def feed(self, chunk: dict[str, Any]) -> None:
        # Runs once per SSE event (hundreds per answer): one lookup per key, no temporaries. The chunk's
        # own fields here, each choice in `_choice` (one call per choice: a stream carries one per event).
        get = chunk.get
        if get("error"):
            raise RequestFailed(ErrorKind.ERROR_IN_200, f"error chunk mid-stream: {_error_message(chunk['error'])}",
                                metadata=_failure_meta(chunk["error"], get("provider") or self.meta.get("provider")),
                                code=_error_code(chunk["error"]))
        value = get("id")
        if value:
            self.meta["id"] = value
        value = get("provider")
        if value:
            self.meta["provider"] = value
        value = get("model")
        if value:
            self.meta["model"] = value
        value = get("usage")
        if value:
            self.usage = value
            if self.token_limit and type(value) is dict:
                done = value.get("completion_tokens")
                if type(done) is int and done > self.token_limit:  # counts mid-stream (vLLM's continuous usage)
                    raise RequestFailed.ran_past_cap(PastCap(self.cap, done, True, *_usage_of(value)[:2]),
                                                     self.meta.get("provider"))
        value = get("sglext")
        if isinstance(value, dict):  # SGLang may split it over two chunks (its ids in a named event)
            self.sglext = value if self.sglext is None else {**self.sglext, **value}
        value = get("prompt_token_ids")
        if value is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = value
        choices = get("choices")
        if not choices:
            return
        for choice in choices:
            self._choice(choice)
        if self.char_limit and self.chars > self.char_limit:
            raise RequestFailed.ran_past_cap(PastCap(self.cap, self.chars // TEXT_CHARS_PER_TOKEN, False),
                                             self.meta.get("provider"))

    def _choice(self, choice: dict[str, Any]) -> None:
        """One choice of a chunk: its token ids (self-hosted servers), its text delta, its finish reasons."""
        self.choices += 1
        cget = choice.get
        ids = cget("token_ids")
        if isinstance(ids, list):
            if self.token_ids is None:
                self.token_ids = []
            self.token_ids.extend(ids)
        ids = cget("prompt_token_ids")  # a server that puts them on the choice, as SGLang does unstreamed
        if ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = ids
        delta = cget("delta")
        if delta:
            dget = delta.get
            text = dget("content")
            if text:
                self.content.append(text)
                self.chars += len(text)
            text = dget("reasoning") or dget("reasoning_content")
            if text and isinstance(text, str):
                self.reasoning.append(text)
                self.chars += len(text)
            if self.reasoning_details is not None:
                details = dget("reasoning_details")
                if details and type(details) is list:
                    self.reasoning_details.feed(details)
            calls = dget("tool_calls")
            if calls and isinstance(calls, list):
                self._tool_call_deltas(calls)
        value = cget("finish_reason")
        if value:
            self.finish_reason = value
        value = cget("native_finish_reason")
        if value:
            self.native_finish_reason = value

    def _tool_call_deltas(self, calls: list[Any]) -> None:
        """Assemble the calls' deltas by `index`, a server's odd shapes taken as they come, never an error
        (the answer is paid for): a delta that is not an object is no call's; an `index` that is not an
        integer is 0; a `function` that is not an object has no name or arguments; `arguments` sent as an
        object (not text) are its JSON text. A call left with no name or id ends an agent step's
        conversation (records.broken_answer)."""
        for tc in calls:
            if not isinstance(tc, dict):
                continue
            index = tc.get("index", 0)
            slot = self.tool_calls.setdefault(index if type(index) is int else 0, {"function": {"arguments": ""}})
            for k in ("id", "type"):
                if tc.get(k):
                    slot[k] = tc[k]
            fn = tc.get("function")
            fn = fn if isinstance(fn, dict) else {}
            if fn.get("name"):
                slot["function"]["name"] = fn["name"]
            args = fn.get("arguments")
            text = "" if args is None else arguments_text(args)
            slot["function"]["arguments"] += text
            self.chars += len(text)

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content),
                                   "reasoning": "".join(self.reasoning) or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.reasoning_details is not None and self.reasoning_details.items:
            message["reasoning_details"] = self.reasoning_details.joined()
        choice: dict[str, Any] = {"message": message, "finish_reason": self.finish_reason,
                                  "native_finish_reason": self.native_finish_reason}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        body = {**self.meta, "usage": self.usage, "choices": [choice]}
        if self.sglext is not None:
            body["sglext"] = self.sglext
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


def feed_lines(lines: list[bytes], state: StreamState) -> bool:
    """Feed the `data:` lines among `lines` (one decode each); True at `data: [DONE]`."""
    feed, loads = state.feed, orjson.loads
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        try:
            chunk = loads(line[5:])
        except orjson.JSONDecodeError:
            if line[5:].strip() == b"[DONE]":
                state.done = True
                return True
            raise RequestFailed(ErrorKind.BAD_BODY, "a stream chunk is not JSON") from None
        if type(chunk) is dict:
            feed(chunk)
    return False
