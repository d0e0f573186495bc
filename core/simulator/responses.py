"""aiohttp responses the simulator sends: JSON and error bodies, SSE streams paced over time,
and connections closed without any response."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
from aiohttp import web

from draftgen.core.simulator import wire
from draftgen.core.simulator.config import SimConfig

JSON = "application/json"
_DROP_GRACE_S = 5.0  # how long a dropped request waits to be cancelled before giving up
# What the stats record for a request that ends without a response ("drop" or "hang").
NO_RESPONSE = web.RequestKey("draftgen_sim_no_response", str)


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
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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
