"""aiohttp responses the simulator sends: JSON and error bodies, SSE streams paced over time,
and connections closed without any response."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
from aiohttp import web

from draftgen.simulator import wire
from draftgen.simulator.config import SimConfig

JSON = "application/json"
_DROP_GRACE_S = 5.0  # how long a dropped request waits to be cancelled before giving up
# What the stats record for a request that ends without a response ("drop" or "hang").
NO_RESPONSE = web.RequestKey("draftgen_sim_no_response", str)
# The id of the generation a request started: sent as X-Generation-Id with the headers.
GEN_ID = web.RequestKey("draftgen_sim_gen_id", str)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=JSON)


def error(code: int, message: str, metadata: dict[str, Any] | None = None) -> web.Response:
    return web.Response(body=wire.error_json(code, message, metadata), status=code, content_type=JSON)


def rate_limited(cfg: SimConfig, provider: str) -> web.Response:
    resp = error(429, "Provider returned error", {
        "provider_name": provider, "raw": f"{provider} is temporarily rate-limited upstream. Please retry shortly."})
    resp.headers["Retry-After"] = f"{cfg.retry_after_s:g}"
    return resp


async def sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


async def drop(request: web.Request, kind: str) -> web.StreamResponse:
    """Close the connection without a response; the handler is then cancelled by aiohttp."""
    request[NO_RESPONSE] = kind
    if request.transport is not None:
        request.transport.close()
    await asyncio.sleep(_DROP_GRACE_S)
    raise asyncio.CancelledError  # not reached in practice: connection_lost cancels us first


async def open_stream(request: web.Request) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    if GEN_ID in request:
        headers["X-Generation-Id"] = request[GEN_ID]
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    await resp.write(wire.PROCESSING)
    return resp


async def wait_with_comments(resp: web.StreamResponse, seconds: float, every: float) -> None:
    # OpenRouter keeps a waiting stream alive with SSE comments.
    while seconds > 0:
        step = min(every, seconds)
        await asyncio.sleep(step)
        seconds -= step
        if seconds > 0:
            await resp.write(wire.PROCESSING)


async def paced(resp: web.StreamResponse, frames: list[bytes], seconds: float) -> None:
    """Write frames spread over `seconds`, in at most 8 writes (one when there is no delay)."""
    if len(frames) >= 3:  # a keep-alive comment mid-stream too: clients must skip it anywhere
        frames = [*frames[: len(frames) // 3], wire.PROCESSING, *frames[len(frames) // 3:]]
    if not frames:
        await sleep(seconds)
        return
    batches = 1 if seconds <= 0 else min(8, len(frames))
    per = math.ceil(len(frames) / batches)
    for i in range(0, len(frames), per):
        if seconds > 0:
            await asyncio.sleep(seconds / batches)
        await resp.write(b"".join(frames[i:i + per]))


def error_with(code: int, message: str, metadata: dict[str, Any] | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    resp = error(code, message, metadata)
    if headers:
        resp.headers.update(headers)
    return resp


def out_of_credits() -> web.Response:
    return error(402, "Insufficient credits. This account never purchased credits or has a negative balance. "
                      "Add more using https://openrouter.ai/settings/credits")


def budget_403(limit_source: str, limit_usd: float, spend_usd: float, resets_at: str | None) -> web.Response:
    """A spending limit: no Retry-After, since the wait is hours or days."""
    what = {"openrouter_key_limit": "Key limit exceeded (total limit)",
            "openrouter_guardrail_budget": "Guardrail budget limit exceeded",
            "openrouter_workspace_budget": "Workspace budget limit exceeded"}[limit_source]
    scope = {"openrouter_key_limit": "key", "openrouter_guardrail_budget": "guardrail",
             "openrouter_workspace_budget": "workspace"}[limit_source]
    return error(403, f"{what}. Manage it using https://openrouter.ai/settings/keys", {
        "limit_source": limit_source, "scope": scope, "limit_usd": limit_usd, "spend_usd": spend_usd,
        "resets_at": resets_at})


def in_flight_exhausted(budget: float, used: float, retry_after_s: float) -> web.Response:
    return error_with(402, "in_flight_budget_exhausted: your running and recently finished paid requests fill "
                           "your in-flight spending budget; retry after a moment or add credits", {
                          "limit_source": "openrouter_in_flight_budget", "budget_usd": budget,
                          "in_flight_usd": used}, {"Retry-After": f"{max(1, math.ceil(retry_after_s))}"})


def weight_exceeds(budget: float, estimate: float) -> web.Response:
    return error(402, "weight_exceeds_budget: this request's estimated cost is larger than your whole in-flight "
                      "budget; lower max_tokens or the prompt size, or add credits", {
                     "limit_source": "openrouter_credits", "budget_usd": budget, "estimated_cost_usd": estimate})


def rate_limited_by(provider: str | None, retry_after_s: float, limit: int = 1000) -> web.Response:
    """A 429: OpenRouter's own (no metadata) or a provider's (`metadata.provider_name`)."""
    wait = f"{retry_after_s:g}"
    headers = {"Retry-After": wait, "X-RateLimit-Limit": str(limit), "X-RateLimit-Remaining": "0",
               "X-RateLimit-Reset": str(int((time.time() + retry_after_s) * 1000))}
    if provider is None:
        return error_with(429, "Rate limit exceeded: too many requests. Please retry shortly.", None, headers)
    return error_with(429, "Provider returned error", {
        "provider_name": provider, "raw": f"{provider} is temporarily rate-limited upstream. Please retry shortly."},
        headers)


_UPSTREAM_MESSAGES = {
    408: ("Request timed out", "upstream request timeout"),
    500: ("Internal Server Error", "upstream internal error"),
    502: ("Provider returned error", "upstream connect error or disconnect/reset before headers"),
    503: ("No available model provider that meets your routing requirements", None),
    504: ("Gateway Timeout", "upstream request timeout"),
    524: ("Provider timed out", "origin did not answer in time"),
}


def upstream(code: int, provider: str) -> tuple[str, dict[str, Any] | None]:
    """(message, metadata) of a 408/5xx from upstream; the 503 of routing names no provider."""
    message, raw = _UPSTREAM_MESSAGES[code]
    return message, (None if raw is None else {"provider_name": provider, "raw": raw})


def moderation(provider: str, model: str, text: str) -> web.Response:
    return error(403, f"{model} requires moderation on {provider}. Your input was flagged for \"violence\".", {
        "reasons": ["violence"], "flagged_input": text[:100] + ("..." if len(text) > 100 else ""),
        "provider_name": provider, "model_slug": model})


def prompt_400(kind: str, model: str, n_tokens: int, context: int, max_tokens: int | None) -> web.Response:
    if kind == "context_length":
        return error(400, f"This endpoint's maximum context length is {context} tokens. However, you requested "
                          f"about {n_tokens + (max_tokens or 0)} tokens ({n_tokens} of text input, "
                          f"{max_tokens or 0} in the output). Please reduce the length of either one.",
                     {"code": "context_length_exceeded"})
    return error(400, "invalid_prompt: a message in `messages` is invalid (unsupported content)",
                 {"code": "invalid_prompt"})


def provider_400(kind: str, provider: str, what: str) -> web.Response:
    """A provider's own 400, passed on with no code OpenRouter names: the prompt's (`provider_400`) or a
    request parameter every request carries (`bad_parameter`)."""
    raw = ("Input validation error: a message could not be processed" if kind == "provider_400" else
           f"Input validation error: `{what}` is not supported with this model")
    return error(400, "Provider returned error",
                 {"provider_name": provider, "raw": orjson.dumps({"error": {"message": raw}}).decode()})


def no_endpoints(kind: str, model: str, what: str = "the requested parameters") -> web.Response:
    message = {"unknown_model": f"{model} is not a valid model ID",
               "data_policy": "No endpoints found matching your data policy (Paid model training). "
                              "Configure: https://openrouter.ai/settings/privacy",
               "no_allowed_providers": "No allowed providers are available for the selected model.",
               "no_endpoints_support": f"No endpoints found that support {what}."}[kind]
    return error(404, message)
