"""The simulator over loopback: a raw aiohttp client against the real SimServer.

Over 400 lines: the wire format, faults, shaping and control endpoints, each against the same server.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
from importlib import resources
from typing import Any

import aiohttp
import orjson
import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from draftgen.core.errors import DraftgenError
from draftgen.simulator import (
    FAULT_KINDS,
    SimConfig,
    SimServer,
    SimulatorError,
    parse_faults,
    prompt_key,
)
from draftgen.simulator.answers import build_pool
from tests.helpers import SIM_AUTH as AUTH
from tests.helpers import chat_body as body
from tests.helpers import chat_post as post
from tests.helpers import parse_sse

REFERENCE_ROUTING = {"ignore": ["fireworks", "baseten"], "sort": "price", "allow_fallbacks": True,
                     "quantizations": ["int4"]}


def cfg(**kw: Any) -> SimConfig:
    base: dict[str, Any] = dict(seed=1, latency_scale=0.0, mean_completion_tokens=300, pool_size=24)
    base.update(kw)
    return SimConfig(**base)


@functools.cache
def kimi() -> tiktoken.Encoding:
    """The Kimi tokenizer built here independently of the simulator's own loader."""
    folder = resources.files("draftgen.core") / "data" / "kimi-k2"
    table = json.loads((folder / "special_tokens.json").read_text())
    enc = tiktoken.Encoding(name="kimi-test", pat_str="|".join(table["pat_str_alternatives"]),
                            mergeable_ranks=load_tiktoken_bpe(str(folder / "tiktoken.model")),
                            special_tokens=table["named"])
    vector = table["test_vectors"]["plain_text"]
    assert enc.encode_ordinary(vector["text"]) == vector["ids"]
    return enc


def rendered_ids(reasoning: str, content: str) -> list[int]:
    """`{reasoning}</think>{content}<|im_end|>` with the two specials as specials and any
    special-looking text inside reasoning or content as ordinary text."""
    enc = kimi()
    return (enc.encode_ordinary(reasoning) + [enc._special_tokens["</think>"]]
            + enc.encode_ordinary(content) + [enc._special_tokens["<|im_end|>"]])


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


# -- wire format -----------------------------------------------------------------------------


async def test_plain_response_wire_format(session):
    async with SimServer(cfg(), port=0) as sim:
        assert sim.base_url.startswith("http://127.0.0.1:") and sim.base_url.endswith("/api/v1")
        status, headers, raw = await post(session, sim, body(provider=REFERENCE_ROUTING))
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        d = json.loads(raw)
        assert d["id"].startswith("gen-") and d["object"] == "chat.completion"
        assert d["model"] == "moonshotai/kimi-k2.5" and isinstance(d["created"], int)
        assert d["provider"] in {"DeepInfra", "Together", "Parasail", "AtlasCloud"}  # int4, not ignored
        choice = d["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["native_finish_reason"] == "stop"
        msg = choice["message"]
        assert msg["role"] == "assistant" and msg["content"] and msg["reasoning"]
        assert not msg.get("reasoning_content")  # reasoning comes in `reasoning`, as on OpenRouter
        assert msg["reasoning_details"] == [{"type": "reasoning.text", "text": msg["reasoning"],
                                             "format": "unknown", "index": 0}]
        u = d["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert 0 < u["completion_tokens_details"]["reasoning_tokens"] < u["completion_tokens"]
        price = {p.name: p for p in sim.config.providers}[d["provider"]]
        expected = (u["prompt_tokens"] * price.usd_per_m_in + u["completion_tokens"] * price.usd_per_m_out) / 1e6
        assert u["cost"] == pytest.approx(expected)
        assert sim.stats.billed_usd == pytest.approx(u["cost"])


async def test_sse_stream_carries_the_same_answer(session):
    async with SimServer(cfg(), port=0) as sim:
        _, _, plain = await post(session, sim, body())
        status, headers, raw = await post(session, sim, body(stream=True))
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        chunks, comments, done = parse_sse(raw)
        assert done and comments >= 2  # ": OPENROUTER PROCESSING" comments, before and amid the data
        assert raw.index(b"\n: OPENROUTER PROCESSING") > raw.index(b"data: ")
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        final = chunks[-1]
        assert final["choices"][0]["finish_reason"] == "stop" and "usage" in final
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        # The answer depends on seed and prompt only, so the plain and streamed texts agree.
        msg = json.loads(plain)["choices"][0]["message"]
        assert (reasoning, content) == (msg["reasoning"], msg["content"])
        assert final["usage"]["completion_tokens"] == len(rendered_ids(reasoning, content))


async def test_stream_chunk_tokens_sets_the_tokens_per_event(session):
    texts = {}
    for per in (3, 12):
        async with SimServer(cfg(stream_chunk_tokens=per), port=0) as sim:
            chunks, _, _ = parse_sse((await post(session, sim, body(stream=True, return_token_ids=True)))[2])
        sizes = [len(c["choices"][0]["token_ids"]) for c in chunks[:-1]]
        # Every delta holds `per` tokens but the last of the reasoning and of the content; `</think>`
        # rides on the first content delta.
        assert max(sizes) <= per + 1 and sorted(sizes)[len(sizes) // 2] == per
        texts[per] = ("".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks),
                      "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks), len(chunks))
    assert texts[3][:2] == texts[12][:2] and texts[3][2] > 3 * texts[12][2] - 8


async def test_completion_tokens_are_the_kimi_count_of_the_rendered_answer(session):
    async with SimServer(cfg(pool_size=30), port=0) as sim:
        prompts = [f"Write a python function number {i}" for i in range(6)] + \
                  [f"Solve the equation {i}x = 7" for i in range(6)] + [f"Tell me about {i} bees" for i in range(6)]
        for p in prompts:
            _, _, raw = await post(session, sim, body(p, return_token_ids=True))
            d = json.loads(raw)
            msg, u = d["choices"][0]["message"], d["usage"]
            ids = rendered_ids(msg["reasoning"], msg["content"])
            assert u["completion_tokens"] == len(ids)
            assert u["completion_tokens_details"]["reasoning_tokens"] == len(kimi().encode_ordinary(msg["reasoning"]))
            assert d["choices"][0]["token_ids"] == ids


def test_every_pool_answer_counts_as_the_kimi_tokenizer_counts_it():
    pool = build_pool(1, 300, 0.6, 96)
    answers = [a for group in pool.by_style.values() for a in group]
    # Some code answers carry a literal "<|im_end|>", which must stay ordinary text.
    assert any("<|im_end|>" in a.content for a in answers)
    for a in answers:
        for think in (True, False):
            c = pool.complete(a, None, think)
            assert c.ids == rendered_ids(a.reasoning if think else "", a.content)
            assert c.completion_tokens == len(c.ids)
        for limit in (1, 7, len(a.reasoning_ids) + 1, len(a.reasoning_ids) + 3, a.completion_tokens - 1):
            c = pool.complete(a, limit)
            assert c.finish_reason == "length" and c.completion_tokens <= limit
            assert kimi().decode(c.ids) == (c.reasoning + "</think>" + c.content if c.think_end else c.reasoning)


async def test_reasoning_modes(session):
    async with SimServer(cfg(), port=0) as sim:
        plain = body()
        del plain["include_reasoning"]
        d = json.loads((await post(session, sim, plain))[2])
        assert d["choices"][0]["message"]["reasoning"] is None
        assert d["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
        assert d["usage"]["completion_tokens"] == len(rendered_ids("", d["choices"][0]["message"]["content"]))

        hidden = dict(plain, reasoning={"effort": "high", "exclude": True})
        d = json.loads((await post(session, sim, hidden))[2])
        assert d["choices"][0]["message"]["reasoning"] is None
        assert d["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0  # thought, billed, not shown

        shown = dict(plain, reasoning={"enabled": True})
        d = json.loads((await post(session, sim, shown))[2])
        assert d["choices"][0]["message"]["reasoning"]

        sim.update(reasoning_field="reasoning_content")  # a vLLM/SGLang-style server
        d = json.loads((await post(session, sim, shown))[2])
        msg = d["choices"][0]["message"]
        assert msg["reasoning_content"] and "reasoning" not in msg


async def test_max_tokens_cuts_the_answer_with_finish_reason_length(session):
    async with SimServer(cfg(), port=0) as sim:
        for stream in (False, True):
            # Small max_tokens: the reasoning alone uses it up and the content is empty.
            status, _, raw = await post(session, sim, body(max_tokens=5, stream=stream, return_token_ids=True))
            assert status == 200
            if stream:
                chunks, _, _ = parse_sse(raw)
                content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
                reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks)
                fr, u = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["usage"]
                ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
            else:
                d = json.loads(raw)
                content, reasoning = d["choices"][0]["message"]["content"], d["choices"][0]["message"]["reasoning"]
                fr, u, ids = d["choices"][0]["finish_reason"], d["usage"], d["choices"][0]["token_ids"]
            assert fr == "length" and content == "" and u["completion_tokens"] == 5 == len(ids)
            assert kimi().decode(ids) == reasoning

        # A cut inside the content: reasoning whole, then `</think>`, then part of the content.
        full = json.loads((await post(session, sim, body(return_token_ids=True)))[2])
        n_reasoning = full["usage"]["completion_tokens_details"]["reasoning_tokens"]
        limit = n_reasoning + 4
        d = json.loads((await post(session, sim, body(max_tokens=limit, return_token_ids=True)))[2])
        msg = d["choices"][0]["message"]
        assert d["choices"][0]["finish_reason"] == "length" and d["usage"]["completion_tokens"] == limit
        assert msg["reasoning"] == full["choices"][0]["message"]["reasoning"]
        assert full["choices"][0]["message"]["content"].startswith(msg["content"]) and msg["content"]
        assert d["choices"][0]["token_ids"] == full["choices"][0]["token_ids"][:limit]
        assert sim.stats.finish_reasons == {"length": 3, "stop": 1}


# -- routing, credits, auth ------------------------------------------------------------------


async def test_provider_routing(session):
    async with SimServer(cfg(fallback_rate=0.0), port=0) as sim:
        async def providers(prefs: dict[str, Any], n: int = 12) -> set[str]:
            seen = set()
            for i in range(n):
                status, _, raw = await post(session, sim, body(f"route {i} {json.dumps(prefs)}", provider=prefs))
                assert status == 200, raw
                seen.add(json.loads(raw)["provider"])
            return seen

        assert await providers({"quantizations": ["int4"]}) <= {"DeepInfra", "Together", "Parasail", "AtlasCloud"}
        assert await providers({"ignore": ["fireworks", "baseten", "DeepInfra"]}) & {"Fireworks", "Baseten",
                                                                                       "DeepInfra"} == set()
        assert await providers({"only": ["together"]}) == {"Together"}
        assert await providers(REFERENCE_ROUTING) == {"DeepInfra"}  # cheapest int4, no outage drawn
        assert await providers({"order": ["parasail", "together"], "allow_fallbacks": False}) == {"Parasail"}
        sim.update(fallback_rate=1.0)  # the first choice is always "down"
        assert await providers(REFERENCE_ROUTING) <= {"Together", "Parasail", "AtlasCloud"}
        assert await providers({"order": ["parasail"], "allow_fallbacks": False}) == {"Parasail"}

        status, _, raw = await post(session, sim, body(provider={"only": ["fireworks"], "quantizations": ["int4"]}))
        err = json.loads(raw)["error"]
        assert status == 404 and err["code"] == 404 and err["message"].startswith("No endpoints found")
        assert sim.stats.by_status["404"] == 1


async def test_health_answers_as_vllm_and_sglang_do_for_a_router(session):
    """sglang-router and vllm-router route to a worker only once GET {worker}/health answers 200; the
    simulator is given to them as http://HOST:PORT/api (docs/routers.md). No key is asked for."""
    async with SimServer(cfg(), port=0) as sim:
        for path in ("/health", "/api/health"):
            async with session.get(f"http://127.0.0.1:{sim.port}{path}") as r:
                assert r.status == 200, path


async def test_credits_fall_with_spend_and_402_when_they_run_out(session):
    async with SimServer(cfg(credits=0.01), port=0) as sim:
        async with session.get(f"{sim.base_url}/credits", headers=AUTH) as r:
            assert (await r.json())["data"] == {"total_credits": 0.01, "total_usage": 0.0}
        statuses = []
        for i in range(40):
            status, _, raw = await post(session, sim, body(f"spend {i}", max_tokens=500))
            statuses.append(status)
            if status == 402:
                err = json.loads(raw)["error"]
                assert err["code"] == 402 and "credits" in err["message"]
                break
        assert statuses[0] == 200 and statuses[-1] == 402
        spent = sim.stats.billed_usd
        async with session.get(f"{sim.base_url}/credits", headers=AUTH) as r:
            data = (await r.json())["data"]
        assert data["total_usage"] == pytest.approx(spent) and data["total_credits"] - spent < 0.01
        async with session.get(f"{sim.base_url}/key", headers=AUTH) as r:
            key = (await r.json())["data"]
        # No per-key cap: limit and limit_remaining are null, whatever the balance (docs/openrouter.md).
        assert key["limit"] is None and key["limit_remaining"] is None and key["is_free_tier"] is False
        assert key["usage"] == pytest.approx(spent)
        assert "sk-test" not in json.dumps(key)

        sim.set_balance(5.0)  # topped up
        assert (await post(session, sim, body("after top-up", max_tokens=500)))[0] == 200
        sim.set_balance(0.0)
        assert (await post(session, sim, body("drained", max_tokens=500)))[0] == 402
        sim.update(credits_forbidden=True)  # a non-management key: /credits refused, /key still works
        async with session.get(f"{sim.base_url}/credits", headers=AUTH) as r:
            assert r.status == 403


async def test_generation_endpoint(session):
    async with SimServer(cfg(), port=0) as sim:
        d = json.loads((await post(session, sim, body(provider=REFERENCE_ROUTING)))[2])
        async with session.get(f"{sim.base_url}/generation", params={"id": d["id"]}, headers=AUTH) as r:
            g = (await r.json())["data"]
        assert g["id"] == d["id"] and g["total_cost"] == d["usage"]["cost"]
        assert g["tokens_completion"] == d["usage"]["completion_tokens"] and g["provider_name"] == d["provider"]
        assert g["native_tokens_reasoning"] == d["usage"]["completion_tokens_details"]["reasoning_tokens"]
        async with session.get(f"{sim.base_url}/generation", params={"id": "gen-nope"}, headers=AUTH) as r:
            assert r.status == 404


async def test_auth(session):
    async with SimServer(cfg(), port=0) as sim:
        assert (await post(session, sim, body(), headers={}))[0] == 401
        assert (await post(session, sim, body(), headers={"Authorization": "Bearer "}))[0] == 401
    async with SimServer(cfg(api_key="sk-right"), port=0) as sim:
        status, _, raw = await post(session, sim, body(), headers={"Authorization": "Bearer sk-wrong"})
        assert status == 401 and b"sk-right" not in raw and b"sk-wrong" not in raw
        assert (await post(session, sim, body(), headers={"Authorization": "Bearer sk-right"}))[0] == 200
        async with session.get(f"{sim.base_url}/credits") as r:
            assert r.status == 401
        async with session.get(f"http://127.0.0.1:{sim.port}/_sim/config") as r:
            assert (await r.json())["api_key"] == "(set)"


async def test_bad_requests_get_400(session):
    async with SimServer(cfg(), port=0) as sim:
        async with session.post(f"{sim.base_url}/chat/completions", data=b"{not json", headers=AUTH) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == 400
        assert (await post(session, sim, {"model": "m", "messages": []}))[0] == 400
        assert (await post(session, sim, body(max_tokens=0)))[0] == 400


# -- faults ----------------------------------------------------------------------------------


async def _outcome(session: aiohttp.ClientSession, sim: SimServer, stream: bool) -> tuple[Any, ...]:
    try:
        async with session.post(f"{sim.base_url}/chat/completions", json=body(stream=stream), headers=AUTH,
                                timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            try:
                return r.status, r.headers, await r.read()
            except (TimeoutError, aiohttp.ClientPayloadError) as exc:  # cut after the headers
                return "cut", r.headers, type(exc)
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        return "error", type(exc), None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", FAULT_KINDS)
async def test_each_fault_at_rate_one(session, kind, stream):
    async with SimServer(cfg(faults={kind: 1.0}, retry_after_s=7, hang_s=30), port=0) as sim:
        status, headers, raw = await _outcome(session, sim, stream)
        if kind in ("429", "500", "502", "503", "524"):
            _assert_error_status(kind, status, headers, raw)
        elif kind in ("drop", "hang"):
            _assert_cut(kind, stream, status, headers, raw)
        elif stream:
            _assert_broken_stream(kind, status, raw)
        else:
            _assert_broken_body(kind, status, raw)
        for _ in range(100):  # a dropped or abandoned handler is cancelled a moment later
            if sim.stats.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        st = sim.stats
        assert st.faults == {kind: 1} and st.answers_total == 0
        assert st.in_flight == 0 and st.requests_total == 1
        # A generation that ran is billed though nobody read it (docs/openrouter.md, "Billing"); one
        # that failed or never started is free (faults.py says which is which).
        if kind in ("drop", "hang", "truncated"):
            assert st.generations_billed == 1 and st.billed_usd > 0
        else:
            assert st.generations_billed == 0 and st.billed_usd == 0


def _assert_error_status(kind: str, status: Any, headers: Any, raw: bytes) -> None:
    """An error status: OpenRouter's JSON error (Retry-After on a 429), or Cloudflare's 524 page."""
    if kind == "524":
        assert status == 524 and raw == b"error code: 524"  # Cloudflare's page, not JSON
        return
    err = json.loads(raw)["error"]
    assert status == int(kind) and err["code"] == int(kind)
    if kind == "429":
        assert headers["Retry-After"] == "7"
    # docs/openrouter.md: a provider's error names it in metadata.provider_name; the 503 of routing
    # (every allowed provider down or full) is OpenRouter's own and names none.
    assert ("provider_name" in err.get("metadata", {})) is (kind != "503"), err


def _assert_cut(kind: str, stream: bool, status: Any, headers: Any, raw: Any) -> None:
    """A dropped or hung connection: a stream's 200 and generation id are out first, then it is cut."""
    if stream:  # as OpenRouter sends them
        assert status == "cut" and headers["X-Generation-Id"].startswith("gen-")
        assert issubclass(raw, aiohttp.ClientPayloadError if kind == "drop" else asyncio.TimeoutError)
    elif kind == "drop":
        assert status == "error" and issubclass(headers, aiohttp.ServerDisconnectedError)
    else:
        assert status == "error" and issubclass(headers, asyncio.TimeoutError)


def _assert_broken_body(kind: str, status: Any, raw: bytes) -> None:
    """A plain 200 that goes wrong: half a body, an error inside it, finish_reason "error", no choices."""
    assert status == 200
    if kind == "truncated":
        with pytest.raises(json.JSONDecodeError):
            json.loads(raw)
    elif kind == "error200":
        d = json.loads(raw)
        assert "choices" not in d and d["error"]["message"] and d["error"]["metadata"]["provider_name"]
    elif kind == "finish_error":
        assert json.loads(raw)["choices"][0]["finish_reason"] == "error"
    else:
        assert json.loads(raw)["choices"] == []


def _assert_broken_stream(kind: str, status: Any, raw: bytes) -> None:
    """A stream that goes wrong after its 200: cut mid-chunk, an error chunk, finish_reason "error", no choices."""
    assert status == 200
    if kind == "truncated":
        lines = raw.decode().rstrip("\n").split("\n")
        assert "data: [DONE]" not in lines
        with pytest.raises(json.JSONDecodeError):
            json.loads(lines[-1][len("data: "):])
        return
    chunks, _, _ = parse_sse(raw)
    if kind == "error200":
        assert chunks[-1]["error"]["message"] and chunks[-1]["choices"][0]["finish_reason"] == "error"
        assert chunks[-1]["error"]["metadata"]["provider_name"] == chunks[-1]["provider"]
    elif kind == "finish_error":
        assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    else:
        assert chunks[-1]["choices"] == []


async def test_fault_rates_and_max_in_flight(session):
    async with SimServer(cfg(faults=parse_faults("429=0.3,500=0.1,error200=0.1")), port=0) as sim:
        statuses = [(await post(session, sim, body(f"p{i}")))[0] for i in range(200)]
        st = sim.stats
        assert st.faults["429"] == statuses.count(429) and 30 <= statuses.count(429) <= 90
        assert st.faults["500"] == statuses.count(500)
        assert st.answers_total + st.faults.get("error200", 0) == statuses.count(200)
    async with SimServer(cfg(fixed_latency_s=0.3, max_in_flight=5), port=0) as sim:
        results = await asyncio.gather(*(post(session, sim, body(f"c{i}")) for i in range(12)))
        assert sorted(r[0] for r in results) == [200] * 5 + [429] * 7
        assert all(r[1]["Retry-After"] for r in results if r[0] == 429)


# -- determinism, counters, control ----------------------------------------------------------


async def _run(session: aiohttp.ClientSession, seed: int) -> list[tuple[Any, ...]]:
    async with SimServer(cfg(seed=seed, faults={"429": 0.3, "500": 0.1}, tokens_drift=0.5), port=0) as sim:
        out = []
        for i in range(25):
            status, _, raw = await post(session, sim, body(f"determinism {i % 10}"))
            d = json.loads(raw)
            if status == 200:
                msg = d["choices"][0]["message"]
                out.append((status, d["provider"], msg["content"], d["usage"]["completion_tokens"]))
            else:
                out.append((status, d["error"]["message"]))
        return out


async def test_same_seed_same_run(session):
    first, again, other = await _run(session, 5), await _run(session, 5), await _run(session, 6)
    assert first == again
    assert first != other


async def test_tokens_drift(session):
    async with SimServer(cfg(tokens_drift=1.0), port=0) as sim:
        d = json.loads((await post(session, sim, body()))[2])
        msg = d["choices"][0]["message"]
        assert abs(d["usage"]["completion_tokens"] - len(rendered_ids(msg["reasoning"], msg["content"]))) == 1


async def test_peak_concurrency_and_per_prompt_counts(session):
    async with SimServer(cfg(fixed_latency_s=0.5), port=0) as sim:
        payloads = [body(f"concurrent {i}") for i in range(60)]
        results = await asyncio.gather(*(post(session, sim, p) for p in payloads))
        assert all(r[0] == 200 for r in results)
        st = sim.stats
        assert st.peak_in_flight == 60 and st.in_flight == 0 and st.requests_total == 60
        key = prompt_key(payloads[7]["messages"])
        assert st.prompt_requests[key] == 1 and st.prompt_answers[key] == 1
        assert st.prompt_cost[key] == pytest.approx(json.loads(results[7][2])["usage"]["cost"])
        assert sum(st.answers_by_provider.values()) == 60


async def test_control_endpoints_drive_a_running_server(session):
    async with SimServer(cfg(), port=0) as sim:
        ctl = f"http://127.0.0.1:{sim.port}/_sim"
        async with session.post(f"{ctl}/config", json={"faults": {"429": 1.0}, "retry_after_s": 2}) as r:
            assert r.status == 200 and (await r.json())["faults"] == {"429": 1.0}
        status, headers, _ = await post(session, sim, body())
        assert status == 429 and headers["Retry-After"] == "2"
        async with session.post(f"{ctl}/config", json={"faults": {}, "balance": 0}) as r:
            assert r.status == 200
        assert (await post(session, sim, body()))[0] == 402
        async with session.post(f"{ctl}/config", json={"balance": 10}) as r:
            assert r.status == 200
        assert (await post(session, sim, body()))[0] == 200
        async with session.post(f"{ctl}/config", json={"no_such_field": 1}) as r:
            assert r.status == 400 and "no_such_field" in (await r.json())["error"]["message"]
        async with session.post(f"{ctl}/config", json={"seed": 99}) as r:
            assert r.status == 400 and "seed" in (await r.json())["error"]["message"]
        async with session.get(f"{ctl}/stats") as r:
            stats = await r.json()
        assert stats["requests_total"] == 3 and stats["by_status"] == {"429": 1, "402": 1, "200": 1}
        assert stats["prompt_requests"][prompt_key(body()["messages"])] == 3
        assert stats["balance"] == pytest.approx(sim.balance) and sim.balance < 10
        async with session.get(f"{ctl}/stats", params={"prompts": "0"}) as r:
            assert "prompt_requests" not in await r.json()


async def test_a_client_that_leaves_is_not_counted_in_flight_but_is_billed(session, caplog):
    # docs/openrouter.md, "Billing": a plain request runs on and is billed in full; an aborted stream
    # is billed up to the abort (tests/simulator/test_simulator_scenarios.py checks the amounts).
    async with SimServer(cfg(fixed_latency_s=0.6), port=0) as sim:
        with pytest.raises(TimeoutError):  # gives up before the answer: the handler is cancelled
            await post(session, sim, body(), timeout=aiohttp.ClientTimeout(total=0.2))
        async with session.post(f"{sim.base_url}/chat/completions", json=body(stream=True), headers=AUTH) as r:
            assert (await r.content.readline()).startswith(b": OPENROUTER PROCESSING")
            r.close()  # leaves mid-stream
        for _ in range(200):
            if sim.stats.in_flight == 0 and sim.stats.generations_running == 0:
                break
            await asyncio.sleep(0.02)
        st = sim.stats
        assert st.in_flight == 0 and st.by_status == {"cancelled": 2}
        assert st.answers_total == 0 and st.generations_billed == 2 and st.cancelled_total == 1
        assert st.billed_usd > 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_parse_faults():
    assert parse_faults("429=0.3, 500=0.1,drop=0.05,error_body=0.01") == {
        "429": 0.3, "500": 0.1, "drop": 0.05, "error200": 0.01}
    assert parse_faults("") == {}
    for bad in ("teapot=0.1", "429", "429=x", "429=1.5", "429=0.6,500=0.6"):
        with pytest.raises(SimulatorError) as exc:
            parse_faults(bad)
        assert isinstance(exc.value, DraftgenError) and "faults" in str(exc.value)
    with pytest.raises(SimulatorError, match="latency_scale"):
        SimConfig(latency_scale=-1)


def test_cli_serves_until_interrupted(tmp_path):
    script = ("import argparse, sys\n"
              "from draftgen.simulator import cli\n"
              "p = argparse.ArgumentParser(); cli.add_arguments(p)\n"
              "sys.exit(cli.run(p.parse_args()))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, "--port", "0", "--latency-scale", "0",
                             "--mean-tokens", "300", "--faults", "429=0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "DRAFTGEN_SIM_KEY": "sk-cli-secret"})
    try:
        first = proc.stdout.readline()
        assert "http://127.0.0.1:" in first, first + proc.stderr.read()
        base_url = first.split(" at ")[1].strip()

        async def ask() -> list[int]:
            async with aiohttp.ClientSession() as s:
                out = []
                for i in range(6):
                    async with s.post(f"{base_url}/chat/completions", json=body(f"cli {i}"),
                                      headers={"Authorization": "Bearer sk-cli-secret"}) as r:
                        out.append(r.status)
                return out

        statuses = asyncio.run(ask())
        assert set(statuses) <= {200, 429} and 200 in statuses
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "sk-cli-secret" not in first + out + err
        assert "requests 6" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("style", ["openrouter", "openrouter_text", "self_hosted"])
async def test_a_multi_turn_prompt_count_is_exact_against_the_rendered_history_and_every_request_is_logged(
        style: str) -> None:
    from draftgen.core.tokens.reconstruct import reconstruct
    from draftgen.core.tokens.template import load_template
    from draftgen.core.tokens.tokenizer import bundled_kimi
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    users = ["Name a prime.", "And the next one?", "Sum them, and say <|im_end|> as text."]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    sent_bodies = []
    async with SimServer(cfg(sent_log_size=8)) as sim, aiohttp.ClientSession() as s:
        for k, text in enumerate(users, 1):
            messages = [*messages, {"role": "user", "content": text}]
            sent_bodies.append(messages)
            status, _, raw = await post(s, sim, body(messages=messages))
            assert status == 200
            reply = orjson.loads(raw)
            msg, usage = reply["choices"][0]["message"], reply["usage"]
            # The provider's count is the Kimi-K2.5 rendering of this history (earlier answers without reasoning).
            rendered = reconstruct(tok, template, messages, msg.get("reasoning"), msg["content"])
            assert usage["prompt_tokens"] == rendered.prompt_tokens, f"turn {k}"
            assert len(rendered.history_spans) == k - 1
            # The answer goes back as the API documents it (reasoning under the key of `style`).
            back: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
            if style == "openrouter":
                back["reasoning_details"] = msg["reasoning_details"]
            else:
                back["reasoning" if style == "openrouter_text" else "reasoning_content"] = msg["reasoning"]
            messages = [*messages, back]
        # What the simulator was sent, in order, with what it counted.
        logged = sim.sent
        assert [x.messages for x in logged] == sent_bodies and [x.seq for x in logged] == [1, 2, 3]
        assert logged[2].prompt_tokens > logged[1].prompt_tokens > logged[0].prompt_tokens > 0
        async with s.get(f"http://127.0.0.1:{sim.port}/_sim/sent") as r:
            assert [x["messages"] for x in await r.json()] == sent_bodies
    async with SimServer(cfg()) as quiet, aiohttp.ClientSession() as s:  # kept only when asked for
        await post(s, quiet, body())
        assert quiet.sent == ()


async def test_the_sent_log_keeps_the_latest_requests() -> None:
    async with SimServer(cfg(sent_log_size=2)) as sim, aiohttp.ClientSession() as s:
        for i in range(4):
            await post(s, sim, body(f"q{i}"))
        assert [x.messages[0]["content"] for x in sim.sent] == ["q2", "q3"]
    with pytest.raises(SimulatorError, match="sent_log_size"):
        SimConfig(sent_log_size=-1)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "reasoning_details"])
def test_inside_a_tool_loop_the_count_keeps_the_reasoning_under_any_key(key: str) -> None:
    from draftgen.core.tokens.reconstruct import reconstruct
    from draftgen.core.tokens.template import load_template
    from draftgen.core.tokens.tokenizer import bundled_kimi
    from draftgen.simulator.answers import answer_tokenizer
    from draftgen.simulator.prompt import prompt_token_count
    tok = bundled_kimi()
    reasoning = "I should look it up first."
    value: Any = [{"type": "reasoning.text", "text": reasoning}] if key == "reasoning_details" else reasoning
    call = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Look it up."},
                {"role": "assistant", "content": "", "tool_calls": [call], key: value},
                {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "42"}]
    count = prompt_token_count(answer_tokenizer(), messages)
    assert count == reconstruct(tok, load_template("kimi-k2.5", tok), messages, "", "").prompt_tokens
    assert count > prompt_token_count(answer_tokenizer(), [*messages[:1], {**messages[1], key: ""}, messages[2]])
