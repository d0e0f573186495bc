"""The simulator's scenarios (every row of docs/openrouter.md's table), billing, generation records,
/credits vs /key and the models listing, over loopback with a raw aiohttp client. Over 400
lines: one parametrized check per row of the table, plus billing that needs the rows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from draftgen.simulator import SimConfig, SimServer, SimulatorError, prompt_key
from draftgen.simulator.models import per_token
from draftgen.simulator.scenarios import SCENARIOS, parse_scenarios
from tests.helpers import SIM_AUTH as AUTH
from tests.helpers import chat_body as body
from tests.helpers import chat_post as post
from tests.helpers import parse_sse

ONLY_DEEPINFRA = {"only": ["deepinfra"]}


def cfg(**kw: Any) -> SimConfig:
    base: dict[str, Any] = {"seed": 1, "latency_scale": 0.0, "mean_completion_tokens": 300, "pool_size": 24,
                            "fallback_rate": 0.0}
    base.update(kw)
    return SimConfig(**base)


async def get(s: aiohttp.ClientSession, url: str, headers: dict[str, str] = AUTH) -> tuple[int, Any]:
    async with s.get(url, headers=headers) as r:
        return r.status, await r.json()


async def settled(sim: SimServer) -> None:
    """Until every generation started has been billed and every handler has ended."""
    while sim.stats.generations_running or sim.stats.in_flight:
        await asyncio.sleep(0.02)


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


# -- every row, plain and SSE -------------------------------------------------------------------

# name -> (params, HTTP status, metadata that must be there (key: value or ... for "present"))
ERROR_ROWS: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "revoked_key": ({}, 401, {}),
    "payload_too_large": ({}, 413, {}),
    "unknown_model": ({}, 404, {}),
    "data_policy": ({}, 404, {}),
    "no_allowed_providers": ({}, 404, {}),
    "no_endpoints_support": ({"what": "reasoning"}, 404, {}),
    "max_tokens_exceeded": ({"limit": 4096}, 400, {"code": "max_tokens_exceeded"}),
    "context_length": ({}, 400, {"code": "context_length_exceeded"}),
    "invalid_prompt": ({}, 400, {"code": "invalid_prompt"}),
    "provider_400": ({}, 400, {"provider_name": "DeepInfra", "raw": ...}),
    "bad_parameter": ({"what": "top_k"}, 400, {"provider_name": "DeepInfra", "raw": ...}),
    "moderation": ({}, 403, {"reasons": ["violence"], "flagged_input": ..., "provider_name": "DeepInfra",
                             "model_slug": "moonshotai/kimi-k2.5"}),
    "key_limit": ({}, 403, {"limit_source": "openrouter_key_limit", "limit_usd": 0.0, "spend_usd": 0.0,
                            "resets_at": None}),
    "guardrail_budget": ({"limit": 5}, 403, {"limit_source": "openrouter_guardrail_budget", "limit_usd": 5.0,
                                              "spend_usd": 0.0, "resets_at": ...}),
    "workspace_budget": ({}, 403, {"limit_source": "openrouter_workspace_budget", "limit_usd": ...,
                                   "spend_usd": ..., "resets_at": ...}),
    "out_of_credits": ({}, 402, {}),
    "weight_exceeds_budget": ({}, 402, {"limit_source": "openrouter_credits"}),
    "in_flight_budget": ({"ratio": 1e-9}, 402, {"limit_source": "openrouter_credits"}),  # alone above it
    "rate_limited": ({"provider": 1.0, "retry_after": 3}, 429, {"provider_name": "DeepInfra", "raw": ...}),
    "request_timeout": ({}, 408, {"provider_name": "DeepInfra"}),
    "no_provider_503": ({}, 503, {}),
    "provider_500": ({}, 500, {"provider_name": "DeepInfra", "raw": ...}),
    "provider_502": ({}, 502, {"provider_name": "DeepInfra", "raw": ...}),
    "gateway_504": ({}, 504, {"provider_name": "DeepInfra", "raw": ...}),
    "gateway_524": ({}, 524, {"provider_name": "DeepInfra", "raw": ...}),
}
MESSAGES = {
    "revoked_key": "User not found.",
    "no_allowed_providers": "No allowed providers are available for the selected model.",
    "no_provider_503": "No available model provider that meets your routing requirements",
}
STARTS = {"unknown_model": "moonshotai/kimi-k2.5 is not a valid model ID",
          "data_policy": "No endpoints found matching your data policy",
          "no_endpoints_support": "No endpoints found that support reasoning",
          "key_limit": "Key limit exceeded (total limit)", "weight_exceeds_budget": "weight_exceeds_budget",
          "out_of_credits": "Insufficient credits"}


def test_every_row_of_the_table_is_a_scenario_and_documented():
    assert set(ERROR_ROWS) | {"error_body", "finish_error", "empty_choices", "stream_error"} == \
        {s.name for s in SCENARIOS}
    section = (Path(__file__).resolve().parents[2] / "docs" / "simulate.md").read_text()
    for s in SCENARIOS:
        assert f"| `{s.name}` | {s.status} | {s.klass} | {s.sends} |" in section, s.name


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("name", list(ERROR_ROWS))
async def test_error_rows_wire_shape(session, name, stream):
    params, status, meta = ERROR_ROWS[name]
    async with SimServer(cfg(scenarios={name: params}), port=0) as sim:
        got, headers, raw = await post(session, sim, body(provider=ONLY_DEEPINFRA, stream=stream))
        # Decided before any generation: the status and a JSON error body, streamed or not.
        assert got == status and headers["Content-Type"].startswith("application/json"), raw
        err = json.loads(raw)["error"]
        assert err["code"] == status and isinstance(err["message"], str) and err["message"]
        assert err["message"] == MESSAGES.get(name, err["message"])
        assert err["message"].startswith(STARTS.get(name, ""))
        for k, v in meta.items():
            assert k in err["metadata"] and (v is ... or err["metadata"][k] == v), (k, err)
        if status == 429:
            assert headers["Retry-After"] == "3"
            assert headers["X-RateLimit-Limit"] and headers["X-RateLimit-Remaining"] == "0"
            assert int(headers["X-RateLimit-Reset"]) > 0
        else:
            assert "Retry-After" not in headers  # the 402/403 account limits: the wait is not seconds
        st = sim.stats
        assert st.scenarios == {name: 1} and st.billed_usd == 0 and st.generations_billed == 0
        listed = (await get(session, f"http://127.0.0.1:{sim.port}/_sim/scenario"))[1]["on"]
        assert listed[name]["hits"] == 1 and listed[name]["live"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("name", ["error_body", "finish_error", "empty_choices", "stream_error"])
async def test_answers_that_carry_an_error(session, name, stream):
    async with SimServer(cfg(scenarios={name: {}}), port=0) as sim:
        status, headers, raw = await post(session, sim, body(stream=stream))
        assert status == 200 and headers["X-Generation-Id"].startswith("gen-")
        if not stream:
            d = json.loads(raw)
            if name in ("error_body", "stream_error"):
                assert "choices" not in d and d["error"]["code"] == 502 and d["error"]["message"]
            elif name == "finish_error":
                choice = d["choices"][0]
                assert choice["finish_reason"] == "error" and choice["error"]["message"]
                assert d["id"] == headers["X-Generation-Id"] and d["usage"]["cost"] == 0
            else:
                assert d["choices"] == []
        else:
            chunks, comments, _ = parse_sse(raw)
            assert comments >= 1 and raw.startswith(b": OPENROUTER PROCESSING")
            last = chunks[-1]
            if name in ("error_body", "stream_error"):
                assert last["error"]["code"] == 502 and last["choices"][0]["finish_reason"] == "error"
                assert len(chunks) > 1  # part of the answer came first
            elif name == "finish_error":
                assert last["choices"][0]["finish_reason"] == "error" and last["choices"][0]["error"]["message"]
                assert last["usage"]["cost"] == 0
            else:
                assert last["choices"] == []
            assert all(c["id"] == headers["X-Generation-Id"] for c in chunks)
        st = sim.stats
        assert st.scenarios == {name: 1} and st.billed_usd == 0 and st.answers_total == 0


@pytest.mark.parametrize("name", ["request_timeout", "no_provider_503", "provider_500", "provider_502",
                                  "gateway_504", "gateway_524"])
async def test_upstream_errors_mid_stream(session, name):
    async with SimServer(cfg(scenarios={name: {"midstream": True}}), port=0) as sim:
        status, headers, raw = await post(session, sim, body(stream=True, provider=ONLY_DEEPINFRA))
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        chunks, comments, done = parse_sse(raw)
        assert comments >= 1 and not done and len(chunks) == 1
        err = chunks[0]["error"]
        code = {"request_timeout": 408, "no_provider_503": 503}.get(name) or int(name[-3:])
        assert err["code"] == code and chunks[0]["choices"][0]["finish_reason"] == "error"
        assert chunks[0]["id"] == headers["X-Generation-Id"]
        # Plain requests still get the status itself.
        assert (await post(session, sim, body(provider=ONLY_DEEPINFRA)))[0] == code
        assert sim.stats.billed_usd == 0


# -- switching: at start, at run time, rate/after/duration/match ---------------------------------


async def test_control_endpoint_switches_scenarios_and_recovery(session):
    async with SimServer(cfg(), port=0) as sim:
        ctl = f"http://127.0.0.1:{sim.port}/_sim"
        assert (await post(session, sim, body("first")))[0] == 200
        spent = sim.stats.billed_usd

        async with session.post(f"{ctl}/scenario", json={"name": "key_limit", "on": True}) as r:
            assert r.status == 200 and "key_limit" in (await r.json())["on"]
        status, headers, raw = await post(session, sim, body("capped"))
        meta = json.loads(raw)["error"]["metadata"]
        assert status == 403 and meta["limit_usd"] == pytest.approx(spent) and "Retry-After" not in headers
        key = (await get(session, f"{sim.base_url}/key"))[1]["data"]
        assert key["limit"] == pytest.approx(spent) and key["limit_remaining"] == 0
        async with session.post(f"{ctl}/scenario", json={"name": "key_limit", "on": False}) as r:
            assert r.status == 200 and (await r.json())["on"] == {}
        assert (await post(session, sim, body("capped")))[0] == 200

        # A configured cap reached by spending, raised through the control endpoint.
        async with session.post(f"{ctl}/config", json={"key_limit_usd": sim.stats.billed_usd}) as r:
            assert r.status == 200
        assert (await post(session, sim, body("over")))[0] == 403
        async with session.post(f"{ctl}/config", json={"key_limit_usd": 50}) as r:
            assert r.status == 200
        assert (await post(session, sim, body("over")))[0] == 200
        key = (await get(session, f"{sim.base_url}/key"))[1]["data"]
        assert key["limit"] == 50 and key["limit_remaining"] == pytest.approx(50 - sim.stats.billed_usd)

        # Out of credits, then credits added.
        async with session.post(f"{ctl}/scenario", json={"name": "out_of_credits"}) as r:
            assert r.status == 200
        assert (await post(session, sim, body("broke")))[0] == 402
        credits = (await get(session, f"{sim.base_url}/credits"))[1]["data"]
        assert credits["total_credits"] - credits["total_usage"] <= 0
        async with session.post(f"{ctl}/scenario", json={"clear": True}) as r:
            assert (await r.json())["on"] == {}
        async with session.post(f"{ctl}/config", json={"add_credits": 5}) as r:
            assert (await r.json())["credits"] == 105
        assert (await post(session, sim, body("broke")))[0] == 200

        # A revoked key: 401 everywhere, until switched off.
        sim.scenario("revoked_key")
        assert (await post(session, sim, body()))[0] == 401
        assert (await get(session, f"{sim.base_url}/key"))[0] == 401
        sim.scenario("revoked_key", on=False)
        assert (await get(session, f"{sim.base_url}/key"))[0] == 200

        for bad, word in (({"name": "teapot"}, "teapot"), ({"name": "rate_limited", "params": {"rate": 2}}, "rate"),
                          ({"name": "key_limit", "params": {"nope": 1}}, "nope"), ({}, "name")):
            async with session.post(f"{ctl}/scenario", json=bad) as r:
                assert r.status == 400 and word in (await r.json())["error"]["message"]


async def test_after_duration_rate_and_match(session):
    async with SimServer(cfg(scenarios={"provider_502": {"after": 3600}}), port=0) as sim:
        assert (await post(session, sim, body()))[0] == 200  # not yet in effect
        on = (await get(session, f"http://127.0.0.1:{sim.port}/_sim/scenario"))[1]["on"]["provider_502"]
        assert on["live"] is False and on["starts_in_s"] > 3000
        sim.scenario("provider_502", duration=3600)
        assert (await post(session, sim, body()))[0] == 502
        sim.scenario("provider_502", duration=0)  # in effect for no time at all: cleared by itself
        assert (await post(session, sim, body()))[0] == 200
        assert sim.scenarios.to_json() == {}

        sim.scenario("moderation", match="forbidden topic")
        assert (await post(session, sim, body("a forbidden topic, please")))[0] == 403
        assert (await post(session, sim, body("a fine topic")))[0] == 200
        sim.scenario("moderation", on=False)

        # A prompt's own problem is drawn per prompt: the same prompts are hit on every retry.
        sim.scenario("context_length", rate=0.5)
        first = [(await post(session, sim, body(f"p{i}")))[0] for i in range(40)]
        again = [(await post(session, sim, body(f"p{i}")))[0] for i in range(40)]
        assert first == again and 5 < first.count(400) < 35 and set(first) == {200, 400}
        sim.scenario("context_length", on=False)
        # A transient one per request.
        sim.scenario("rate_limited", rate=0.5)
        statuses = [(await post(session, sim, body("same prompt")))[0] for _ in range(40)]
        assert 5 < statuses.count(429) < 35


def test_parse_scenarios():
    assert parse_scenarios("key_limit:after=30, rate_limited:rate=0.2:retry_after=3") == {
        "key_limit": {"after": 30.0}, "rate_limited": {"rate": 0.2, "retry_after": 3.0}}
    assert parse_scenarios("provider_502:midstream=1") == {"provider_502": {"midstream": True}}
    for bad, word in (("teapot", "teapot"), ("key_limit:after", "KEY=VALUE"), ("rate_limited:rate=x", "rate"),
                      ("moderation:limit=3", "limit"), ("rate_limited:rate=1.5", "rate")):
        with pytest.raises(SimulatorError, match=word):
            parse_scenarios(bad)
    with pytest.raises(SimulatorError, match="teapot"):
        SimConfig(scenarios={"teapot": {}})


# -- billing ---------------------------------------------------------------------------------------


async def test_abandoned_plain_request_is_billed_in_full(session):
    async with SimServer(cfg(fixed_latency_s=0.5), port=0) as sim:
        payload = body("abandoned", provider=ONLY_DEEPINFRA)
        with pytest.raises(TimeoutError):
            await post(session, sim, payload, timeout=aiohttp.ClientTimeout(total=0.1))
        await settled(sim)
        st = sim.stats
        assert st.generations_billed == 1 and st.cancelled_total == 0 and st.answers_total == 0
        # The same prompt again, read this time: same answer, same provider, same price.
        status, headers, raw = await post(session, sim, payload)
        d = json.loads(raw)
        assert status == 200 and d["id"] == headers["X-Generation-Id"]
        assert st.billed_usd == pytest.approx(d["usage"]["cost"], abs=1e-12)
        st = sim.stats
        assert st.billed_usd == pytest.approx(2 * d["usage"]["cost"], abs=1e-12)
        assert st.prompt_answers[prompt_key(payload["messages"])] == 2


async def test_cancelled_stream_is_billed_up_to_the_cancel(session):
    async with SimServer(cfg(fixed_latency_s=2.0, mean_completion_tokens=600), port=0) as sim:
        payload = body("a long answer, streamed", provider=ONLY_DEEPINFRA, return_token_ids=True, stream=True)
        received = 0
        async with session.post(f"{sim.base_url}/chat/completions", json=payload, headers=AUTH) as r:
            gen_id = r.headers["X-Generation-Id"]  # with the headers, before any token
            while received == 0:
                line = await r.content.readline()
                if line.startswith(b"data: "):
                    received += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            r.close()
        await settled(sim)
        # Not visible until the delay is over: 404, as an unknown id.
        sim.update(generation_delay_s=3600)
        assert (await get(session, f"{sim.base_url}/generation?id={gen_id}"))[0] == 404
        sim.update(generation_delay_s=0)
        status, g = await get(session, f"{sim.base_url}/generation?id={gen_id}")
        g = g["data"]
        assert status == 200 and g["cancelled"] is True and g["streamed"] is True and g["finish_reason"] is None
        st = sim.stats
        assert st.cancelled_total == 1 and g["total_cost"] == pytest.approx(st.billed_usd, abs=1e-12)
        full = json.loads((await post(session, sim, dict(payload, stream=False)))[2])
        assert received <= g["native_tokens_completion"] < full["usage"]["completion_tokens"]
        assert 0 < g["total_cost"] < full["usage"]["cost"]
        price = sim.config.providers[0]
        assert g["total_cost"] == pytest.approx((g["native_tokens_prompt"] * price.usd_per_m_in +
                                                 g["native_tokens_completion"] * price.usd_per_m_out) / 1e6)


async def test_generation_record_of_an_answer(session):
    async with SimServer(cfg(generation_delay_s=3600), port=0) as sim:
        for stream in (False, True):
            status, headers, raw = await post(session, sim, body(f"record {stream}", stream=stream))
            assert status == 200
            gen_id = headers["X-Generation-Id"]
            usage = parse_sse(raw)[0][-1]["usage"] if stream else json.loads(raw)["usage"]
            url = f"{sim.base_url}/generation?id={gen_id}"
            assert (await get(session, url))[0] == 404  # billed, the record not out yet
            sim.update(generation_delay_s=0)
            g = (await get(session, url))[1]["data"]
            sim.update(generation_delay_s=3600)
            assert g["total_cost"] == usage["cost"] and g["native_tokens_completion"] == usage["completion_tokens"]
            assert g["native_tokens_prompt"] == usage["prompt_tokens"] and g["cancelled"] is False
            assert g["native_tokens_reasoning"] == usage["completion_tokens_details"]["reasoning_tokens"]
            assert g["streamed"] is stream and g["finish_reason"] == "stop" and g["provider_name"]
        assert (await get(session, f"{sim.base_url}/generation?id=gen-x", headers={}))[0] == 401


async def test_in_flight_budget(session):
    # 4 requests' worst case fits the budget, a 5th does not; one request with max_tokens 40,000
    # alone is above the whole budget.
    price = SimConfig().providers[0]
    worst = (30 * price.usd_per_m_in + 1000 * price.usd_per_m_out) / 1e6
    ratio = 4.5 * worst / 100.0
    async with SimServer(cfg(fixed_latency_s=600, credits=100.0, scenarios={"in_flight_budget": {"ratio": ratio}}),
                         port=0) as sim:
        running = [asyncio.create_task(post(session, sim, body(f"r{i}", max_tokens=1000, provider=ONLY_DEEPINFRA)))
                   for i in range(4)]
        while sim.stats.generations_running < 4:
            await asyncio.sleep(0.02)
        status, headers, raw = await post(session, sim, body("fifth", max_tokens=1000, provider=ONLY_DEEPINFRA))
        err = json.loads(raw)["error"]
        assert status == 402 and err["metadata"]["limit_source"] == "openrouter_in_flight_budget"
        assert int(headers["Retry-After"]) >= 1 and err["message"].startswith("in_flight_budget_exhausted")
        status, headers, raw = await post(session, sim, body("huge", max_tokens=40_000, provider=ONLY_DEEPINFRA))
        assert status == 402 and json.loads(raw)["error"]["message"].startswith("weight_exceeds_budget")
        assert "Retry-After" not in headers
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        assert sim.stats.scenarios == {"in_flight_budget": 2}


# -- account and models ----------------------------------------------------------------------------


async def test_credits_need_a_management_key_and_key_shows_the_cap(session):
    async with SimServer(cfg(api_key="sk-ordinary", management_keys=("sk-mgmt",)), port=0) as sim:
        ordinary, mgmt = {"Authorization": "Bearer sk-ordinary"}, {"Authorization": "Bearer sk-mgmt"}
        assert (await post(session, sim, body(), headers=ordinary))[0] == 200
        status, data = await get(session, f"{sim.base_url}/credits", ordinary)
        assert status == 403 and "management" in data["error"]["message"]
        status, data = await get(session, f"{sim.base_url}/credits", mgmt)
        assert status == 200 and data["data"]["total_usage"] == pytest.approx(sim.stats.billed_usd)
        assert (await get(session, f"{sim.base_url}/credits", {"Authorization": "Bearer sk-other"}))[0] == 401
        key = (await get(session, f"{sim.base_url}/key", ordinary))[1]["data"]
        assert key["limit"] is None and key["limit_remaining"] is None and key["limit_reset"] is None
        assert key["usage"] == pytest.approx(sim.stats.billed_usd) and key["is_free_tier"] is False
        sim.update(key_limit_usd=2.5, key_limit_reset="monthly")
        key = (await get(session, f"{sim.base_url}/key", ordinary))[1]["data"]
        assert key["limit"] == 2.5 and key["limit_reset"] == "monthly"
        assert key["limit_remaining"] == pytest.approx(2.5 - sim.stats.billed_usd)
        assert "sk-" not in json.dumps(key)


async def test_models_and_endpoints_listing(session):
    async with SimServer(cfg(models=("moonshotai/kimi-k2.5",)), port=0) as sim:
        status, data = await get(session, f"{sim.base_url}/models/moonshotai/kimi-k2.5/endpoints")
        assert status == 200
        endpoints = data["data"]["endpoints"]
        assert [e["provider_name"] for e in endpoints] == [p.name for p in sim.config.providers]
        for e, p in zip(endpoints, sim.config.providers, strict=True):
            assert isinstance(e["pricing"]["prompt"], str) and isinstance(e["pricing"]["completion"], str)
            assert float(e["pricing"]["prompt"]) * 1e6 == pytest.approx(p.usd_per_m_in)
            assert float(e["pricing"]["completion"]) * 1e6 == pytest.approx(p.usd_per_m_out)
            assert e["quantization"] == p.quantization and e["tag"].startswith(p.slug)
            assert e["max_completion_tokens"] == p.max_completion_tokens and e["context_length"] == p.context_length
            assert "max_tokens" in e["supported_parameters"] and e["max_prompt_tokens"] and "status" in e
        sim.scenario("max_tokens_exceeded", limit=2048)
        data = (await get(session, f"{sim.base_url}/models/moonshotai/kimi-k2.5/endpoints"))[1]
        assert {e["max_completion_tokens"] for e in data["data"]["endpoints"]} == {2048}
        assert (await post(session, sim, body(max_tokens=2048)))[0] == 200
        assert (await post(session, sim, body(max_tokens=2049)))[0] == 400
        models = (await get(session, f"{sim.base_url}/models"))[1]["data"]
        assert models[0]["id"] == "moonshotai/kimi-k2.5" and models[0]["top_provider"]["max_completion_tokens"] == 2048
        assert (await get(session, f"{sim.base_url}/models/someone/else/endpoints"))[0] == 404
        status, _, raw = await post(session, sim, body(model="someone/else"))
        assert status == 404 and "not a valid model ID" in json.loads(raw)["error"]["message"]
    assert per_token(2.25) == "0.00000225" and per_token(0.45) == "0.00000045"


def test_cli_scenario_flag_reaches_the_config():
    import argparse

    from draftgen.simulator import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--scenario", "key_limit:after=30,rate_limited:rate=0.2", "--scenario", "moderation",
                         "--key-limit", "5", "--management-key", "sk-m", "--generation-delay", "1.5"])
    c = cli.config_from_args(args)
    assert c.scenarios == {"key_limit": {"after": 30.0}, "rate_limited": {"rate": 0.2}, "moderation": {}}
    assert c.key_limit_usd == 5 and c.management_keys == ("sk-m",) and c.generation_delay_s == 1.5
