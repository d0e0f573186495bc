"""How a request shapes its answer, free of HTTP: the seeded draws, the reasoning mode, the
prompt's size, the latency, and the deliberate misbehaviours (SimConfig.misbehave, echo_key)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from draftgen.simulator import wire
from draftgen.simulator.config import SimConfig, SimProvider

_U32 = float(1 << 32)


def bearer_key(request: web.Request) -> str:
    """The key the request was made with (its Authorization header)."""
    return request.headers.get("Authorization", "").partition(" ")[2].strip()


def echo_key(request: web.Request, resp: web.StreamResponse, encoded: bool = False) -> None:
    """SimConfig.echo_key: put the caller's bearer key into an error body (not into answers); with
    `encoded` (echo_key_fields), its encoded forms as well (a stream's error frames: wire.error_frame)."""
    key = bearer_key(request)
    unprefixed = key.split("-")[-1]
    # Every form a careless upstream quotes a key in: as sent, re-cased, without its prefix, a fragment.
    note = (f" (request made with key {key}; KEY={key.upper()}; key={key.lower()}; token {unprefixed}; "
            f"fragment {key[len(key) // 2:len(key) // 2 + 12]}..."
            + (f"; {wire.echo_note(key)}" if encoded else "") + ")")

    def edit(err: dict[str, Any]) -> None:
        err["message"] = f"{err.get('message', '')}{note}"
        meta = err.get("metadata")
        if isinstance(meta, dict):
            meta["raw"] = f"{meta.get('raw', '')}{note}"
        if encoded:  # the metadata too: a provider's name, a nested object, a key used as a key
            meta = meta if isinstance(meta, dict) else {"raw": note}
            err["metadata"] = {**meta, "provider_name": f"{meta.get('provider_name') or 'Echo'} [{key}]",
                               "echo": {"forms": [note], key: "as a key"}}
    _edit_error(resp, edit, note)


def hostile_error(resp: web.StreamResponse, text: str) -> None:
    """SimConfig.hostile_text: put `text` into an error body's message and metadata (`raw`,
    `provider_name`), or after a plain-text body (a stream: wire.error_frame); none: nothing changed."""
    if not text:
        return

    def edit(err: dict[str, Any]) -> None:
        err["message"] = f"{err.get('message', '')} {text}"
        meta = err.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        err["metadata"] = {**meta, "raw": f"{meta.get('raw', '')}{text}",
                           "provider_name": f"{meta.get('provider_name') or 'Hostile'}{text}"}
    _edit_error(resp, edit, text)


def _edit_error(resp: web.StreamResponse, edit: Callable[[dict[str, Any]], None], plain: str) -> None:
    """An error body's `error` object changed by `edit`, or `plain` put after a plain-text error body; a
    stream or an answer is left as it is."""
    if not isinstance(resp, web.Response):  # a stream: nothing to rewrite
        return
    body = resp.body
    if not isinstance(body, bytes) or (resp.status < 400 and b'"error"' not in body):
        return
    try:
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            raise ValueError("no error object")
        edit(err)
        resp.body = orjson.dumps(obj)
    except ValueError:  # orjson.JSONDecodeError included: a plain-text body (524)
        resp.body = body + plain.encode()


def draws(seed: int, key: str, n: int) -> list[float]:
    """Eight uniforms in [0, 1) for the n-th request of a prompt under this seed."""
    digest = hashlib.blake2b(f"{seed}:{key}:{n}".encode(), digest_size=32).digest()
    return [int.from_bytes(digest[i:i + 4], "little") / _U32 for i in range(0, 32, 4)]


def reasoning_mode(body: dict[str, Any]) -> tuple[bool, bool]:
    """(the model thinks, the reasoning is returned) from `reasoning` / `include_reasoning`."""
    opt = body.get("reasoning")
    if isinstance(opt, dict):
        think = opt.get("enabled", True) is not False and opt.get("effort") != "none"
        return think, think and not opt.get("exclude", False)
    if opt is not None and opt is not False:
        return True, True
    return (True, True) if body.get("include_reasoning") is True else (False, False)


def last_user_text(messages: list[Any]) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human"):
            content = m.get("content", m.get("value"))
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def latency(cfg: SimConfig, provider: SimProvider, tokens: int, u_jitter: float,
             u_slow: float) -> tuple[float, float]:
    """(total latency, time to first token) in seconds."""
    if cfg.fixed_latency_s is not None:
        return cfg.fixed_latency_s, cfg.fixed_latency_s * 0.2
    if cfg.latency_scale == 0:
        return 0.0, 0.0
    jitter = 1.0 + cfg.jitter * (2.0 * u_jitter - 1.0)
    if u_slow < 0.05:  # a slow replica now and then: the long tail a run really sees
        jitter *= 3.0
    ttft = provider.ttft_s * jitter * cfg.latency_scale
    return ttft + tokens / provider.tokens_per_s * jitter * cfg.latency_scale, ttft


def stream_end(r: wire.Reply, cfg: SimConfig) -> bytes:
    """The last chunk of a streamed answer, with the misbehaviours that touch it: no cost in the usage,
    or the connection closed after the finish_reason chunk, before the usage chunk and [DONE]."""
    if "no_usage_chunk" in cfg.misbehave:
        return wire.final_frame(r, with_usage=False)
    if "no_cost" in cfg.misbehave:
        r = dataclasses.replace(r, usage={k: v for k, v in r.usage.items() if k != "cost"})
    return wire.final_frame(r) + wire.DONE


def misbehave(data: bytes, cfg: SimConfig, prefs: Any) -> bytes:
    """Break an answer the ways a real endpoint has: for showing each smoke check can fail."""
    obj = orjson.loads(data)
    message = obj["choices"][0]["message"]
    usage = obj["usage"]
    for what in cfg.misbehave:
        if what == "no_reasoning":
            message["reasoning"] = None
            message.pop("reasoning_details", None)
            message.pop("reasoning_content", None)
        elif what == "wrong_model":
            obj["model"] = "someone/another-model"
        elif what == "no_cost":
            usage.pop("cost", None)
        elif what == "ignore_routing":
            ignored = (prefs or {}).get("ignore") if isinstance(prefs, dict) else None
            slug = (ignored or ["fireworks"])[0]
            obj["provider"] = next((p.name for p in cfg.providers if p.slug == slug), "Fireworks")
        elif what == "bad_token_count":
            usage["completion_tokens"] += 50
        elif what == "tool_calls":
            message["tool_calls"] = [{"id": "call_0", "type": "function",
                                      "function": {"name": "lookup", "arguments": "{}"}}]
    return orjson.dumps(obj)
