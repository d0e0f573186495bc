"""How each fault looks on the wire, which one (if any) a request meets, and who pays.

Billing, as OpenRouter bills (see generations.py):
- 429, 500, 502, 503, 524: answered before any generation starts: free. Each carries
  X-Generation-Id, as every completion response does; the 5xx ones (where a provider may have run)
  get that id's record, with total_cost 0, so a client that looks them up can price them.
- drop: the connection is closed at the first token. The generation goes on: a plain request is
  billed in full when it would have finished; a stream is aborted there, so billed for the
  prompt and the tokens produced by then.
- hang: nothing for hang_s, then the connection is closed. The generation runs to its end
  upstream and is billed in full, once the connection is gone (a stream: up to the abort).
  A stream's headers (with X-Generation-Id) are sent first, as OpenRouter sends them at once; a
  plain request's come with its body, so a dropped or hung plain request leaves no id.
- truncated: the answer is generated and billed in full; its body is cut on the way.
- error200, finish_error, empty_choices: the provider failed; free (usage.cost 0), and the
  generation's record says so (total_cost 0) once the response has ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from aiohttp import web

from draftgen.simulator import responses, wire
from draftgen.simulator.config import FAULT_KINDS, SimConfig
from draftgen.simulator.generations import Generation

# `choices[0].error` of an answer that ended with finish_reason "error".
PROVIDER_ERROR = {"code": 502, "message": "Provider returned error: generation stopped"}


def pick_fault(faults: Mapping[str, float], u: float) -> str | None:
    """The fault a request with uniform draw `u` meets, walking the kinds in a fixed order."""
    if not faults:
        return None
    for kind in FAULT_KINDS:
        rate = faults.get(kind)
        if rate:
            u -= rate
            if u < 0:
                return kind
    return None


async def serve_fault(request: web.Request, cfg: SimConfig, fault: str, r: wire.Reply, ttft: float,
                      latency: float, stream: bool, fragments: wire.FragmentCache,
                      start: Callable[[], Generation], finish: Callable[[Generation], object],
                      failed: Callable[[], None]) -> web.StreamResponse:
    """The response of a request that meets `fault` (see config.FAULT_KINDS); `start()` starts
    the billed generation of the faults that have one (drop, hang, truncated), `finish()` bills it,
    `failed()` records the unbilled generation of an error inside a 200 once its response is out."""
    if fault == "429":
        return responses.rate_limited(cfg, r.provider)
    if fault in ("500", "502", "503", "524"):
        # The request carried X-Generation-Id (as every completion does), and the provider or the
        # gateway failed before billing anything: its record says total_cost 0.
        failed()
    if fault in ("500", "502", "503"):
        await responses.sleep(ttft)
        if fault in ("500", "502"):  # a provider's error (docs/openrouter.md): `metadata.provider_name` and `raw`
            return responses.error(int(fault), *responses.upstream(int(fault), r.provider))
        # All allowed providers down or full: OpenRouter's own 503 of routing names no provider.
        return responses.error(503, *responses.upstream(503, r.provider))
    if fault == "524":
        await responses.sleep(latency)
        # Cloudflare answers an origin timeout with its own plain-text page, not JSON.
        return web.Response(status=524, text="error code: 524", content_type="text/plain")
    if fault in ("drop", "hang"):
        request[responses.NO_RESPONSE] = fault  # recorded even if the client gives up first
        # When the connection closes, the ledger hears the generation was abandoned (completions.py).
        start()
        if stream:  # a stream's 200 and X-Generation-Id are out before anything goes wrong
            await responses.open_stream(request)
        await responses.sleep(ttft if fault == "drop" else cfg.hang_s)
        return await responses.drop(request, fault)
    g = start() if fault == "truncated" else None
    if not stream:
        await responses.sleep(latency)
        return _whole_fault(fault, r, g, fragments, finish, failed)
    return await _streamed_fault(request, cfg, fault, r, g, ttft, latency, fragments, finish, failed)


def _whole_fault(fault: str, r: wire.Reply, g: Generation | None, fragments: wire.FragmentCache,
                 finish: Callable[[Generation], object], failed: Callable[[], None]) -> web.Response:
    """A plain (not streamed) 200 that goes wrong: half a body (truncated, billed) or an error inside it."""
    if g is not None:
        finish(g)
        full = wire.completion_json(r, fragments)
        return web.Response(body=full[: len(full) // 2], content_type=responses.JSON)
    if fault == "error200":
        body = wire.error_json(502, "Provider returned error", {"provider_name": r.provider})
    elif fault == "finish_error":
        body = wire.completion_json(unbilled(r), None, "error", r.completion.content[:200], PROVIDER_ERROR)
    else:
        body = wire.empty_choices_json(r)
    failed()
    return web.Response(body=body, content_type=responses.JSON)


async def _streamed_fault(request: web.Request, cfg: SimConfig, fault: str, r: wire.Reply, g: Generation | None,
                          ttft: float, latency: float, fragments: wire.FragmentCache,
                          finish: Callable[[Generation], object], failed: Callable[[], None]) -> web.StreamResponse:
    """A stream whose 200 and some of the answer are already out when it goes wrong."""
    meta = {"provider_name": r.provider}
    resp = await responses.open_stream(request)
    await responses.wait_with_comments(resp, ttft, cfg.processing_comment_s)
    frames = wire.delta_frames(r, fragments)
    half = frames[: len(frames) // 2]
    if fault == "empty_choices":
        await resp.write(wire.empty_choices_frame(r) + wire.DONE)
    elif g is not None:  # truncated: the generation ran to its end, the stream is cut on the way
        await responses.paced(resp, half, max(0.0, latency - ttft) / 2)
        last = frames[len(half)] if len(frames) > len(half) else wire.final_frame(r)
        await resp.write(last[: len(last) // 2])
        finish(g)
    elif fault == "error200":
        await responses.paced(resp, half, max(0.0, latency - ttft) / 2)
        await resp.write(wire.error_frame(r, 502, "Provider returned error: upstream disconnected", meta))
    else:  # finish_error
        await responses.paced(resp, half, max(0.0, latency - ttft) / 2)
        await resp.write(wire.final_frame(unbilled(r), "error", PROVIDER_ERROR) + wire.DONE)
    await resp.write_eof()
    if g is None:  # an error inside a 200 (truncated was billed in full)
        failed()
    return resp


def unbilled(r: wire.Reply) -> wire.Reply:
    """The same reply with a zero cost: a failed generation is not billed."""
    return dataclasses.replace(r, usage={**r.usage, "cost": 0.0})
