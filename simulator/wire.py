"""OpenRouter's wire format: completion bodies, SSE chunks and error bodies, as bytes.

Shapes follow OpenRouter's chat completions API: a body has `id` ("gen-..."), `provider`,
`model`, `object`, `created`, `choices[0]` with `finish_reason`, `native_finish_reason` and a
`message` carrying `reasoning` and `reasoning_details` ([{type: "reasoning.text", text}]), and
`usage` with `cost` and `completion_tokens_details.reasoning_tokens`. Errors are
`{"error": {"code": N, "message": ..., "metadata"?: {...}}}` with the same HTTP status; a stream
reports a mid-generation error as a chunk with `error` and `finish_reason: "error"`.

Bodies are spliced from pre-serialised parts: the per-request head (id, provider, model...) and
the per-answer message or SSE deltas, which are cached per pool answer, so a request costs a
few byte joins rather than serialising kilobytes of text again.
"""

from __future__ import annotations

import base64
import codecs
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from draftgen.simulator.answers import Completion

PROCESSING = b": OPENROUTER PROCESSING\n\n"
DONE = b"data: [DONE]\n\n"
# Tokens per SSE delta by default: real streams send a few tokens a chunk; a dozen keeps frames few.
# SimConfig.stream_chunk_tokens sets it per server (the streaming benchmark uses OpenRouter's few).
TOKENS_PER_CHUNK = 12

# Serialised parts of whole answers, keyed by (answer, variant); bounded by pool size x variants.
FragmentCache = dict[tuple[Any, ...], Any]


def error_json(code: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    err: dict[str, Any] = {"message": message, "code": code}
    if metadata:
        err["metadata"] = metadata
    return orjson.dumps({"error": err})


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int, cost: float) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cost": cost,
        "is_byok": False,
        "prompt_tokens_details": {"cached_tokens": 0},
        "cost_details": {"upstream_inference_cost": None},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


@dataclass(frozen=True, slots=True)
class Reply:
    """What one request is answered with."""

    gen_id: str
    provider: str
    model: str
    created: int
    completion: Completion
    show_reasoning: bool
    reasoning_field: str  # "reasoning" (OpenRouter) or "reasoning_content" (vLLM/SGLang)
    token_ids: bool  # add `token_ids` to the choice, as vLLM's return_token_ids does
    usage: dict[str, Any]
    chunk_tokens: int = TOKENS_PER_CHUNK  # tokens per SSE delta of a streamed answer
    echo: str = ""  # SimConfig.echo_key_fields: the caller's key, quoted in a mid-stream error too
    hostile: str = ""  # SimConfig.hostile_text: before the content and reasoning, in a mid-stream error too
    # The answer's calls when the request sent `tools` (tools.py): `content` "" and finish_reason "tool_calls".
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_ids: tuple[int, ...] = ()  # their token ids (tools.py calls_ids), in place of the content's

    @property
    def ids(self) -> list[int]:
        """Every generated token, specials included: the answer's, its calls in place of its content."""
        c = self.completion
        if not self.tool_calls:
            return c.ids
        return [*c.answer.reasoning_ids[: c.n_reasoning], c.think_end_id, *self.tool_ids, c.im_end_id]

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.completion.finish_reason

    def prefix(self, obj: str) -> bytes:
        """`{"id":..,"provider":..,"model":..,"object":..,"created":..,"choices":[` """
        head = orjson.dumps({"id": self.gen_id, "provider": self.provider, "model": self.model,
                             "object": obj, "created": self.created})
        return head[:-1] + b',"choices":['

    def cache_key(self, kind: str) -> tuple[Any, ...] | None:
        c = self.completion
        if c.finish_reason != "stop" or self.tool_calls:  # cut answers vary with max_tokens, calls with the request
            return None
        return (kind, c.answer, c.think, self.show_reasoning, self.reasoning_field, self.token_ids,
                self.chunk_tokens, self.hostile)


def _reasoning_fields(text: str, field: str) -> dict[str, Any]:
    if field == "reasoning_content":
        return {"reasoning_content": text}
    return {"reasoning": text,
            "reasoning_details": [{"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}]}


def _message(r: Reply, content: str) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": r.hostile + ("" if r.tool_calls else content),
                               "refusal": None}
    if r.tool_calls:
        message["tool_calls"] = list(r.tool_calls)
    if r.show_reasoning:
        message.update(_reasoning_fields(r.hostile + r.completion.reasoning, r.reasoning_field))
    else:
        message["reasoning"] = None
    return orjson.dumps(message)


def completion_json(r: Reply, cache: FragmentCache | None = None, finish_reason: str | None = None,
                    content: str | None = None, error: dict[str, Any] | None = None) -> bytes:
    """The plain (non-streamed) body; `finish_reason`/`content`/`error` (the choice's) for faults."""
    c = r.completion
    key = r.cache_key("message") if cache is not None and content is None else None
    message = cache.get(key) if cache is not None and key is not None else None
    if message is None:
        message = _message(r, c.content if content is None else content)
        if cache is not None and key is not None:
            cache[key] = message
    fr = orjson.dumps(finish_reason or r.finish_reason)
    parts = [r.prefix("chat.completion"), b'{"index":0,"finish_reason":', fr, b',"native_finish_reason":', fr,
             b',"logprobs":null,"message":', message]
    if error is not None:
        parts += [b',"error":', orjson.dumps(error)]
    if r.token_ids:
        parts += [b',"token_ids":', orjson.dumps(r.ids)]
    parts += [b'}],"usage":', orjson.dumps(r.usage), b"}"]
    return b"".join(parts)


def empty_choices_json(r: Reply) -> bytes:
    return r.prefix("chat.completion") + b'],"usage":' + orjson.dumps(usage(r.usage["prompt_tokens"], 0, 0, 0.0)) + b"}"


def _choice(delta: dict[str, Any], ids: list[int] | None, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                              "native_finish_reason": finish, "logprobs": None}
    if ids is not None:
        choice["token_ids"] = ids
    return orjson.dumps(choice)


def _pieces(raw: bytes, ends: tuple[int, ...], ids: tuple[int, ...], n: int,
            per: int) -> Iterator[tuple[str, list[int]]]:
    # Token groups can end inside a UTF-8 character; the incremental decoder carries it over.
    decode = codecs.getincrementaldecoder("utf-8")().decode
    start = 0
    for i in range(0, n, per):
        j = min(i + per, n)
        yield decode(raw[start:ends[j - 1]]), list(ids[i:j])
        start = ends[j - 1]


def _delta_choices(r: Reply) -> list[bytes]:
    c, a = r.completion, r.completion.answer
    with_ids = r.token_ids
    out = []
    if r.hostile:  # SimConfig.hostile_text: a first chunk of it, in the content and the reasoning
        first: dict[str, Any] = {"role": "assistant", "content": r.hostile}
        if r.show_reasoning:
            first.update(_reasoning_fields(r.hostile, r.reasoning_field))
        out.append(_choice(first, [] if with_ids else None))
    for text, ids in _pieces(a.reasoning_bytes, a.reasoning_ends, a.reasoning_ids, c.n_reasoning, r.chunk_tokens):
        delta: dict[str, Any] = {"role": "assistant", "content": ""}
        if r.show_reasoning:
            delta.update(_reasoning_fields(text, r.reasoning_field))
        out.append(_choice(delta, ids if with_ids else None))
    if r.tool_calls and c.think_end:  # the calls, each its id and name first, then its arguments
        for i, call in enumerate(r.tool_calls):
            fn = call["function"]
            ids = [c.think_end_id, *r.tool_ids] if i == 0 else []  # `</think>` and every call's ids come first
            out.append(_choice({"role": "assistant", "content": "", "tool_calls": [
                {"index": i, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}]},
                ids if with_ids else None))
            out.append(_choice({"role": "assistant", "content": "", "tool_calls": [
                {"index": i, "function": {"arguments": fn["arguments"]}}]}, [] if with_ids else None))
    elif c.think_end:  # the content part begins with `</think>`
        pending = [c.think_end_id]
        for text, ids in _pieces(a.content_bytes, a.content_ends, a.content_ids, c.n_content, r.chunk_tokens):
            out.append(_choice({"role": "assistant", "content": text}, pending + ids if with_ids else None))
            pending = []
        if pending:
            out.append(_choice({"role": "assistant", "content": ""}, pending if with_ids else None))
    return out


def delta_frames(r: Reply, cache: FragmentCache | None = None) -> list[bytes]:
    """The SSE frames of the answer's text, reasoning first, without the final chunk."""
    key = r.cache_key("deltas") if cache is not None else None
    choices = cache.get(key) if cache is not None and key is not None else None
    if choices is None:
        choices = _delta_choices(r)
        if cache is not None and key is not None:
            cache[key] = choices
    head = b"data: " + r.prefix("chat.completion.chunk")
    return [head + ch + b"]}\n\n" for ch in choices]


def _frame(r: Reply, choice: bytes, **extra: Any) -> bytes:
    tail = b"]," + orjson.dumps(extra)[1:] if extra else b"]}"
    return b"data: " + r.prefix("chat.completion.chunk") + choice + tail + b"\n\n"


def final_frame(r: Reply, finish_reason: str | None = None, error: dict[str, Any] | None = None,
                with_usage: bool = True) -> bytes:
    c = r.completion
    ids = ([c.im_end_id] if c.im_end else []) if r.token_ids else None
    choice = _choice({"role": "assistant", "content": ""}, ids, finish_reason or r.finish_reason)
    if error is not None:
        choice = choice[:-1] + b',"error":' + orjson.dumps(error) + b"}"
    return _frame(r, choice, usage=r.usage) if with_usage else _frame(r, choice)


def echo_note(key: str) -> str:
    """The key as careless upstreams quote it (SimConfig.echo_key_fields): plain, JSON-escaped
    (`\\u0073...`: lower and upper hex, every other character), percent-encoded (both cases, and some
    characters only), base64 (a Basic credential)."""
    lower = "".join(f"\\u{ord(c):04x}" for c in key)
    upper = "".join(f"\\u{ord(c):04X}" for c in key)
    some = "".join(f"\\u{ord(c):04X}" if i % 2 else c for i, c in enumerate(key))
    url = "".join(f"%{ord(c):02x}" for c in key)
    url_upper = "".join(f"%{ord(c):02X}" for c in key)
    url_some = "".join(f"%{ord(c):02X}" if c in "-_" or i % 3 == 0 else c for i, c in enumerate(key))
    basic = base64.b64encode(f"user:{key}".encode()).decode()
    return (f"key {key}; json {lower}; JSON {upper}; mixed {some}; url {url}; URL {url_upper}; quoted {url_some}; "
            f"auth Basic {basic}")


def error_frame(r: Reply, code: int, message: str, metadata: dict[str, Any] | None = None) -> bytes:
    """A mid-stream error, as OpenRouter sends it once the HTTP 200 is already out: a top-level
    `error` and `finish_reason: "error"`."""
    if r.echo:
        message = f"{message} ({echo_note(r.echo)})"
        metadata = {**(metadata or {}), "raw": echo_note(r.echo), "provider_name": r.provider}
    if r.hostile:
        message = f"{message} {r.hostile}"
        metadata = {**(metadata or {}), "raw": f"{(metadata or {}).get('raw', '')}{r.hostile}",
                    "provider_name": r.provider}
    err: dict[str, Any] = {"code": code, "message": message}
    if metadata:
        err["metadata"] = metadata
    return _frame(r, _choice({"role": "assistant", "content": ""}, None, "error"), error=err)


def empty_choices_frame(r: Reply) -> bytes:
    return b"data: " + empty_choices_json(r) + b"\n\n"
