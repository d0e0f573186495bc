"""The HTTP client for any OpenAI-compatible chat API (OpenRouter first), on aiohttp + orjson.

One `ClientSession` for the life of a run; its connector is sized to the run's concurrency (the
default pool of 100 would silently cap a run at 100). Every failure becomes a `RequestFailed`
whose `kind` says whose problem it is and so how the engine treats it (core/generate/api/classify.py).

Everything upstream says besides the answer's text is redacted here, where it enters (core/secrets.py):
the X-Generation-Id header, `provider`, `model`, `id`, the finish reasons, every error's message and
metadata, a generation record. An upstream that echoes the key in any of them (plain, JSON-escaped,
percent-encoded, base64) gets it into no ledger, record, event, attach stream or panel.

An answer a provider runs past the body's answer cap (core/request_keys.py `past_cap_limits`) is not
returned: a stream is cut (closed by the client) as soon as its usage counts, or its text length, pass
the cap by the margin, and a finished answer whose usage does is refused the same way (PAST_CAP).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from draftgen.core.generate.api.classify import PastCap, RequestFailed, cannot_connect, classify_status
from draftgen.core.generate.api.deadlines import Deadlines
from draftgen.core.records import ErrorKind, Usage, arguments_text, reasoning_text
from draftgen.core.request_keys import TEXT_CHARS_PER_TOKEN, body_max_tokens, past_cap_limits
from draftgen.core.secrets import Redactor
from draftgen.core.servers import ServerProfile

__all__ = ["ChatAnswer", "ChatClient", "RequestFailed", "classify_status", "parse_completion"]


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


def _details_of(message: dict[str, Any]) -> list[Any] | None:
    details = message.get("reasoning_details")
    return details if isinstance(details, list) and details else None


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


def _count(value: Any) -> int | None:
    """A token count as a server sends it: a non-negative integer, also written as an integral float
    (`12.0`) or a string of ASCII digits (`"12"`, as some proxies send numbers); None for anything else
    (negative, fractional, NaN, infinite, a boolean, null, missing, any other string)."""
    if type(value) is int:
        return value if 0 <= value < 1 << 62 else None
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
    prompt, completion = _count(get("prompt_tokens")), _count(get("completion_tokens"))
    reasoning = _count(details.get("reasoning_tokens")) if isinstance(details, dict) else 0
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
    if not _ID_KEYS.isdisjoint(choice) or not _TOP_ID_KEYS.isdisjoint(obj):  # a self-hosted server's ids
        token_ids, prompt_ids = _token_ids(obj, choice), _prompt_token_ids(obj, choice)
    return ChatAnswer(
        mget("content") or "", reasoning, mget("tool_calls") or None, reason, cget("native_finish_reason"),
        get("provider"), get("model"), get("id"), used, latency_s, token_ids, priced, prompt_ids,
        reasoning_details=_details_of(message), doubt=doubt)


# Where a body may carry token ids (_token_ids, _prompt_token_ids): on the choice, at the top level.
_ID_KEYS = frozenset({"token_ids", "response_token_ids", "prompt_token_ids"})
_TOP_ID_KEYS = frozenset({"prompt_token_ids", "sglext"})


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


def get_failure(path: str, e: RequestFailed) -> str:
    """A failed `get_json(path)` said with its path once: its messages for a connection or a body it could
    not read name the request already, a status's does not."""
    return e.message if e.message.startswith(f"GET {path}") else f"GET {path}: {e.message}"


def redacted(e: RequestFailed, redact: Redactor) -> RequestFailed:
    """The failure with its message and metadata (every string in it) redacted, in place."""
    e.message = redact(e.message)
    e.args = (e.message,)
    e.metadata = redact.deep(e.metadata)
    return e


# One SSE line may carry a whole answer (a server that sends it in one event): room for a few MB. A line
# past it is an answer past max_tokens (no answer within a cap needs one so long), whatever its body's bound.
MAX_SSE_LINE = 1 << 24

# Bounded reads (docs/money.md): no body is read whole. An answer's body, streamed or not, is read
# as it arrives, decompressed (aiohttp inflates gzip, deflate, br, zstd a bounded piece at a time), and
# cut once it passes answer_body_limit of the body's answer cap: the attempt has run past max_tokens
# (PAST_CAP: not kept, booked at its worst case or its generation record, billing.py). A token takes
# far fewer bytes than BODY_BYTES_PER_TOKEN even as one SSE event of its own (OpenRouter's ~450 bytes
# with `reasoning_details` beside `reasoning`), or JSON-escaped twice over in a non-streamed body;
# BODY_BYTES_BASE holds the rest (the envelope, usage, a self-hosted server's prompt token ids: ~7 bytes
# a prompt token, 2 MB for 256k, keep-alive comments).
BODY_BYTES_PER_TOKEN = 1024
BODY_BYTES_BASE = 8 << 20
UNCAPPED_BODY_LIMIT = 64 << 20  # a body without an answer cap (draftgen always sends one)
GET_BODY_LIMIT = 16 << 20  # /key, /credits, /generation, /models, /endpoints (OpenRouter's /models: ~1 MB)
ERROR_BODY_LIMIT = 1 << 20  # an error status's body: its message and metadata, the rest dropped


def answer_body_limit(cap: int) -> int:
    """The most bytes (decompressed) an answer's body may take under answer cap `cap`."""
    return cap * BODY_BYTES_PER_TOKEN + BODY_BYTES_BASE if cap > 0 else UNCAPPED_BODY_LIMIT


async def read_upto(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """The body, read as it arrives up to `limit` bytes (decompressed): (what was read, at most `limit`
    bytes; whether more was there). The rest is left unread: the connection is closed, not drained."""
    parts: list[bytes] = []
    size = 0
    async for data in resp.content.iter_any():
        size += len(data)
        if size > limit:
            parts.append(data[:len(data) - (size - limit)])
            return b"".join(parts), True
        parts.append(data)
    return parts[0] if len(parts) == 1 else b"".join(parts), False


def over_long(cap: int, limit: int, provider: str | None = None) -> RequestFailed:
    """An answer's body cut at `limit` bytes: past the answer cap `cap` (PAST_CAP, at its worst case), or a
    bad body when the request carried no cap."""
    if cap <= 0:
        return RequestFailed(ErrorKind.BAD_BODY, f"HTTP 200 with a body over {limit:,} bytes: cut, not kept")
    return RequestFailed.ran_past_cap(PastCap(cap, cap, False, body_bytes=limit), provider)


def origin(url: URL) -> str:
    """scheme://host:port of `url`, the port always written (http://a and http://a:80 are one origin)."""
    return f"{url.scheme}://{url.raw_host}:{url.port}" if url.raw_host else str(url)


def redirect_refused(method: str, resp: aiohttp.ClientResponse) -> RequestFailed:
    """A 3xx: never followed (aiohttp would send the prompt, and the key to the same origin, wherever it
    points). Another scheme, host or port names both origins; the same origin names the target."""
    here = resp.url
    location = resp.headers.get("Location", "")
    try:
        there = here.join(URL(location)) if location else None
    except ValueError:
        there = None
    if there is None or not there.scheme or not there.raw_host:
        where = f"an unusable Location ({location[:200]!r})" if location else "no Location"
        return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect with "
                             f"{where}: not followed",
                             status=resp.status)
    if origin(there) != origin(here):
        return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect from "
                             f"{origin(here)} to another origin, {origin(there)}: not followed (the key and the "
                             f"prompts go to api.base_url's origin only)", status=resp.status)
    return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect to "
                         f"{there.path} on the same origin ({origin(here)}): not followed", status=resp.status)


class _StreamState:
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


def _feed_lines(lines: list[bytes], state: _StreamState) -> bool:
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


class ChatClient:
    """One session, a connector sized to `concurrency`, timeouts per phase, OpenRouter headers."""

    def __init__(self, base_url: str, api_key: str, *, concurrency: int, request_timeout_s: float = 1800.0,
                 connect_timeout_s: float = 30.0, referer: str = "", title: str = "draftgen",
                 redact: Redactor | None = None, server: ServerProfile | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._server = server  # the run's profile: its kind read for an unusual finish reason, a stream's id
        self._api_key = api_key
        self._redact = redact or Redactor(api_key)  # what comes from upstream, as it enters
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        if referer:
            self._headers["HTTP-Referer"] = referer
        if title:
            self._headers["X-Title"] = title
        self._concurrency = concurrency
        # The connect timeout is aiohttp's (per new connection); the request's own is one timer for all (deadlines.py).
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._deadlines = Deadlines(request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def open(self) -> None:
        if self._session is None:
            # A few spare connections for the credit checks beside the answers in flight.
            connector = aiohttp.TCPConnector(limit=self._concurrency + 8, limit_per_host=0,
                                             ttl_dns_cache=300, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers,
                # Answers of 100 KB+ arrive in one body or one SSE line: room for a few MB.
                read_bufsize=1 << 22, max_line_size=1 << 24, max_field_size=1 << 16,
                json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def chat(self, body: dict[str, Any], on_generation: Callable[[str], None] | None = None, *,
                   details: bool = False) -> ChatAnswer:
        """One completion. `on_generation` hears the generation id as soon as the headers carry it
        (X-Generation-Id), before the body: what prices the request if it is abandoned; a stream
        without the header, from its first chunk's `id` (OpenRouter's generation id; not on a
        self-hosted server, whose ids name no record). `details`: a
        stream's `reasoning_details` pieces are joined into the answer's (a non-streamed body's are kept
        as they come either way)."""
        assert self._session is not None, "ChatClient.open() first"
        start = time.monotonic()
        cap = body_max_tokens(body, 0)
        try:
            with self._deadlines:  # api.request_timeout_s, one timer for every request (deadlines.py)
                async with self._session.post(f"{self.base_url}/chat/completions", data=orjson.dumps(body),
                                              allow_redirects=False) as resp:
                    tell = self._header_generation(resp, on_generation)
                    obj = await self._answer_body(resp, cap, bool(body.get("stream")), details, tell)
        except RequestFailed as e:
            raise redacted(e, self._redact) from None
        except TimeoutError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                raise RequestFailed(ErrorKind.CONNECTION, f"cannot connect to {self.base_url}: no answer within "
                                    f"{self._timeout.sock_connect:g} s", unreachable=True) from None
            raise RequestFailed(ErrorKind.TIMEOUT,
                                f"no complete answer within {self._deadlines.timeout_s:g} s") from None
        except aiohttp.ClientPayloadError as e:
            # The connection closed before the body's end (a stream cut after its headers): an answer
            # fault, like a truncated body. It may be this prompt's (a provider that dies on it), so it
            # counts towards max_attempts, but only while other prompts are answered (classify.py): a
            # network outage that cuts every stream fails nothing.
            raise RequestFailed(ErrorKind.BAD_BODY, f"truncated body (connection cut mid-answer): {e}") from None
        except aiohttp.ClientConnectorError as e:
            # No connection, TLS handshake included: nothing was sent (so nothing is billed), and the
            # run waits for the address like any outage, saying why ("... (TLS handshake failed: ...)",
            # classify.cannot_connect). No prompt is failed for it.
            raise RequestFailed(ErrorKind.CONNECTION, cannot_connect(self.base_url, e), unreachable=True) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError, ConnectionError) as e:
            raise RequestFailed(ErrorKind.CONNECTION, f"connection error: {type(e).__name__}: {e}") from None
        except aiohttp.ClientResponseError as e:
            raise RequestFailed(ErrorKind.BAD_BODY, f"bad response: {e.message}") from None
        try:
            answer = parse_completion(obj, time.monotonic() - start, self._server)
            if cap and (n := answer.usage.completion_tokens) > cap and n > past_cap_limits(cap)[0]:  # limit >= cap
                u = answer.usage
                raise RequestFailed.ran_past_cap(PastCap(cap, u.completion_tokens, True, u, answer.priced),
                                                 answer.provider)
        except RequestFailed as e:
            raise redacted(e, self._redact) from None
        return redacted_answer(answer, self._redact)

    async def _answer_body(self, resp: aiohttp.ClientResponse, cap: int, stream: bool, details: bool,
                           on_generation: Callable[[str], None] | None) -> Any:
        """The answer's body, decoded (streamed: joined into the shape of a non-streamed one), read up to its
        bound (a stream tells `on_generation` its first chunk's id); RequestFailed for a redirect, another
        status than 200, a body past its bound or not JSON."""
        if resp.status != 200:
            if 300 <= resp.status < 400:
                raise redirect_refused("POST", resp)
            raise classify_status(resp.status, (await read_upto(resp, ERROR_BODY_LIMIT))[0], resp.headers)
        if stream:
            return await self._read_sse(resp, cap, details, on_generation)
        raw, cut = await read_upto(resp, limit := answer_body_limit(cap))
        if cut:
            raise over_long(cap, limit)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestFailed(ErrorKind.BAD_BODY, f"HTTP 200 with a body that is not JSON "
                                f"({len(raw)} bytes, truncated?)") from None

    def _header_generation(self, resp: aiohttp.ClientResponse,
                           on_generation: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """Tell `on_generation` the X-Generation-Id header's id; returns it when a stream's first chunk
        should tell it instead (no header; None where the kind bills no answers: a self-hosted server's ids
        name no record)."""
        if on_generation is None:
            return None
        gen_id = resp.headers.get("X-Generation-Id")
        if gen_id:
            on_generation(self._redact.known.get(gen_id) or self._redact(gen_id))
            return None
        return None if self._server is not None and not self._server.kind.bills_answers else on_generation

    async def _read_sse(self, resp: aiohttp.ClientResponse, cap: int = 0, details: bool = False,
                        on_generation: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The answer of an SSE stream. Whatever has arrived is taken at once (`iter_any`) and split into
        lines here: aiohttp's line iterator costs a buffer round trip per line, more than the JSON
        decode of the event. Lines that are not `data:` (`: OPENROUTER PROCESSING` keep-alives, blank
        separators, `event:`/`id:` fields) are skipped; each event is decoded once (orjson skips the
        space after `data:` and a `\r` before the newline), and its deltas are joined once at the end.
        `on_generation` hears the first chunk's `id` (the headers carried no generation id)."""
        state = _StreamState(cap, details)
        partial: list[bytes] = []  # a line still arriving, in pieces
        size = 0
        left = limit = answer_body_limit(cap)  # bytes the body may still take (bounded reads, above)
        async for data in resp.content.iter_any():
            left -= len(data)
            if left < 0:
                raise over_long(cap, limit, state.meta.get("provider"))
            if data.find(b"\n") < 0:
                partial.append(data)
                size += len(data)
                if size > MAX_SSE_LINE:  # no answer within its cap needs a line this long: past max_tokens
                    raise over_long(cap, MAX_SSE_LINE, state.meta.get("provider"))
                continue
            if partial:
                partial.append(data)
                data = b"".join(partial)
            lines = data.split(b"\n")
            rest = lines.pop()  # after the last newline: the start of a line still arriving
            partial, size = ([rest], len(rest)) if rest else ([], 0)
            done = _feed_lines(lines, state)
            if on_generation is not None and type(gen_id := state.meta.get("id")) is str:
                on_generation(self._redact.known.get(gen_id) or self._redact(gen_id))
                on_generation = None
            if done:
                break
        else:
            if partial:  # a last line without a newline
                _feed_lines([b"".join(partial)], state)
        if not state.done and state.finish_reason is None:
            raise RequestFailed(ErrorKind.BAD_BODY, "the stream ended before the answer finished")
        if not state.choices:
            # The streamed form of HTTP 200 with `choices: []`: retried, never kept as an empty answer.
            raise RequestFailed(ErrorKind.EMPTY_CHOICES, "HTTP 200 stream with no choices")
        return state.body()

    async def get_json(self, path: str, *, key: str | None = None, at_root: bool = False) -> dict[str, Any]:
        """GET `path` under base_url (e.g. "/key"), with another key when `key` is given (a management
        key for /credits); `at_root`: under the server's root instead (base_url without its "/v1", where
        vLLM's /version and SGLang's /server_info are). RequestFailed for any status but 200."""
        assert self._session is not None
        headers = {"Authorization": f"Bearer {key}"} if key else None
        base = self.base_url.removesuffix("/v1") if at_root else self.base_url
        redact = Redactor(self._api_key, key) if key else self._redact  # another key: cut out as well
        try:
            async with self._session.get(f"{base}{path}", headers=headers, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=30, sock_connect=10)) as resp:
                if 300 <= resp.status < 400:
                    raise redacted(redirect_refused("GET", resp), redact)
                raw, cut = await read_upto(resp, GET_BODY_LIMIT if resp.status == 200 else ERROR_BODY_LIMIT)
                if resp.status != 200:
                    raise redacted(classify_status(resp.status, raw, resp.headers), redact)
                if cut:
                    raise RequestFailed(ErrorKind.BAD_BODY, f"GET {path}: body over {GET_BODY_LIMIT >> 20} MB: "
                                        "not read")
        except aiohttp.ClientConnectorError as e:
            raise RequestFailed(ErrorKind.CONNECTION, f"GET {path}: {cannot_connect(self.base_url, e)}",
                                unreachable=True) from None
        except aiohttp.ClientError as e:  # connected, then the server closed the connection or cut the body
            raise RequestFailed(ErrorKind.CONNECTION, f"GET {path}: {type(e).__name__}: "
                                f"{redact(str(e)) or 'the connection closed before the answer'}") from None
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestFailed(ErrorKind.BAD_BODY, f"GET {path}: body is not JSON") from None
        return redact.deep(obj) if isinstance(obj, dict) else {}

    async def generation(self, gen_id: str) -> dict[str, Any] | None:
        """GET /generation?id=: the generation's record, or None while it is not there yet (404)."""
        try:
            data = (await self.get_json(f"/generation?id={quote(gen_id, safe='')}")).get("data")
        except RequestFailed as e:
            if e.status == 404:
                return None
            raise
        return data if isinstance(data, dict) else None
