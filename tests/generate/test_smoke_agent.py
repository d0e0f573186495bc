"""The smoke test's agent exchange (core/generate/commands/smoke_agent.py): a run with an agent dataset has
its tools, its tool history and its call ids checked before any dataset request is paid for. Against the
simulator on 127.0.0.1 (it answers `tools` with calls, simulator/tools.py), and against a small aiohttp
proxy of this file's own in front of it that refuses `tools` with a 400, or rewrites call ids to `call_…`."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.prices import body_worst_case, fetch_prices
from draftgen.core.generate.commands.smoke import run_smoke, smoke_command
from draftgen.core.generate.commands.smoke_agent import AGENT_TOOLS, TOOL_RESULT
from draftgen.core.rundir import RunDir, iter_jsonl
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.generate.test_agents import trajectory
from tests.generate.test_multiturn import write_conversations
from tests.helpers import TEST_KEY, cli_env, make_config, serve_local

REQUEST = {"temperature": 0.6, "include_reasoning": True}
THOUGHT = "The user wants the time in Paris: call get_time."
HISTORY_REFUSAL = "reasoning_content is required in assistant messages with tool_calls"
REFUSAL = "Provider returned error: tools are not supported \x1b[31mhere\x1b[0m"


def datasets(tmp_path, *, agent: bool = True) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "chat", "n": 3, "max_tokens": 2048}]
    if agent:
        prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", [trajectory(f"m{i}", 2) for i in range(3)])
        out.append({"name": "agent", "prompts": prompts, "turns": "all", "max_tokens": 2048})
    return out


def config(tmp_path, url: str, *, agent: bool = True, validation: dict[str, Any] | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return make_config(tmp_path, url, datasets(tmp_path, agent=agent), request=REQUEST,
                       tables={"tokenizer": {"path": str(bundled_kimi_path())}, "validation": validation or {}})


class Proxy:
    """Forwards every request to the simulator; `refuse_tools`: a chat request carrying `tools` gets a 400
    with REFUSAL; `refuse_history`: one carrying a tool result gets a 400 with HISTORY_REFUSAL;
    `rewrite_ids`: the answer's call ids become `call_…`; `think`: an answer to a request with `tools`
    carries THOUGHT as its `reasoning_content` (as a self-hosted reasoning parser returns it). Keeps the
    chat bodies it was sent."""

    def __init__(self, upstream: str, *, refuse_tools: bool = False, refuse_history: bool = False,
                 rewrite_ids: bool = False, think: bool = False) -> None:
        self.upstream = upstream.rsplit("/api/v1", 1)[0]
        self.refuse_tools = refuse_tools
        self.refuse_history = refuse_history
        self.rewrite_ids = rewrite_ids
        self.think = think
        self.bodies: list[dict[str, Any]] = []
        self.url = ""

    async def __aenter__(self) -> Proxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self._runner, port = await serve_local(app)
        self._session = aiohttp.ClientSession()
        self.url = f"http://127.0.0.1:{port}/api/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()
        await self._runner.cleanup()

    async def forward(self, request: web.Request) -> web.Response:
        data = await request.read()
        chat = request.path.endswith("/chat/completions")
        if chat:
            body = orjson.loads(data)
            self.bodies.append(body)
            if self.refuse_tools and body.get("tools"):
                return web.json_response({"error": {"code": 400, "message": REFUSAL}}, status=400)
            if self.refuse_history and any(m["role"] == "tool" for m in body["messages"]):
                return web.json_response({"error": {"code": 400, "message": HISTORY_REFUSAL}}, status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=data or None,
                                         headers=headers) as up:
            out = await up.read()
            status, ctype = up.status, up.content_type
        if chat and (self.rewrite_ids or self.think and body.get("tools")) and status == 200:
            answer = orjson.loads(out)
            message = answer["choices"][0]["message"]
            for i, call in enumerate(message.get("tool_calls") or [] if self.rewrite_ids else []):
                call["id"] = f"call_{i}abc"
            if self.think:
                message["reasoning_content"] = THOUGHT
            out = orjson.dumps(answer)
        return web.Response(body=out, status=status, content_type=ctype)


def rows(result) -> dict[str, Any]:
    return {r.check: r for r in result.rows}


def smoke_sent(cfg) -> list[dict[str, Any]]:
    """The smoke requests' "sent" lines of the run directory's spend ledger."""
    return [line for _, line in iter_jsonl(RunDir(cfg.run_dir).spend) if line.get("e") == "sent"]


async def test_an_agent_dataset_sends_a_tool_loop_checked_and_on_the_ledger(tmp_path):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, sent_log_size=64), port=0) as sim, \
            Proxy(sim.base_url) as proxy:
        cfg = config(tmp_path, proxy.url)
        result = await run_smoke(cfg, TEST_KEY)
        sent = list(sim.sent)
        async with ChatClient(cfg.api.base_url, TEST_KEY, concurrency=1) as client:
            prices, _ = await fetch_prices(client, cfg)
    by = rows(result)
    assert result.passed, [r for r in result.rows if not r.passed]
    assert "1 tool call(s): 'get_time'" in by["agent: agent step 1 request"].detail
    assert by["agent: agent call ids"].passed and "'functions.get_time:0'" in by["agent: agent call ids"].detail
    for k in (1, 2):  # each answer (step 1's: its call) and each prompt rendered as the server counted them
        for row in ("request", "tokens", "prompt tokens"):
            assert by[f"agent: agent step {k} {row}"].passed, by[f"agent: agent step {k} {row}"]
        assert "(diff 0;" in by[f"agent: agent step {k} prompt tokens"].detail
        assert "(diff 0); all checks pass" in by[f"agent: agent step {k} tokens"].detail
    assert not any(c.startswith("chat: agent") for c in by)
    with_tools = [e for e in sent if e.tools]
    assert len(with_tools) == 2 and all(e.tools == AGENT_TOOLS for e in with_tools)
    # Step 2: the target's own call under its own id, its reasoning as OpenRouter documents it, the result.
    _, call, result_msg = with_tools[1].messages
    assert call["tool_calls"][0]["id"] == "functions.get_time:0" and call["reasoning_details"]
    assert set(call) == {"role", "content", "tool_calls", "reasoning_details"}
    assert result_msg == {"role": "tool", "tool_call_id": "functions.get_time:0", "content": TOOL_RESULT}
    # Money: every request the server got is on the ledger, each reserved from the body sent (tools and
    # history included: step 2's reservation is above step 1's).
    ledger = smoke_sent(cfg)
    assert len(ledger) == len(sent) == len(proxy.bodies) and all(line["ds"] == "(smoke)" for line in ledger)
    reserved = [line["w"] for line in ledger if line["p"] == "smoke:agent"]
    bodies = [b for b in proxy.bodies if b.get("tools")]
    assert reserved == [body_worst_case(prices["agent"], b, 2048) for b in bodies] and reserved[0] < reserved[1]


async def test_a_run_without_agent_lines_sends_no_tool_exchange(tmp_path):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, sent_log_size=64), port=0) as sim:
        cfg = config(tmp_path, sim.base_url, agent=False)
        result = await run_smoke(cfg, TEST_KEY)
        sent = list(sim.sent)
    assert result.passed and not any("agent" in r.check for r in result.rows)
    assert len(sent) == 1 and not sent[0].tools  # one shape, one request, no tools


async def smoke_exit(cfg, capsys) -> tuple[int, str]:
    """`draftgen smoke`'s exit code and what it printed (its own event loop, in a thread)."""
    code = await asyncio.to_thread(smoke_command, cfg, TEST_KEY)
    return code, " ".join(capsys.readouterr().out.split())


async def test_a_provider_refusing_tools_fails_the_check_by_name_before_any_step_is_paid_for(tmp_path, capsys):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim, \
            Proxy(sim.base_url, refuse_tools=True) as proxy:
        cfg = config(tmp_path, proxy.url)
        code, out = await smoke_exit(cfg, capsys)
    assert code == 1 and "\x1b[31m" not in out
    assert ("FAILED: 16/17 checks passed; failed: agent: agent step 1 request (400: HTTP 400: Provider returned "
            "error: tools are not supported \\x1b[31mhere\\x1b[0m") in out, out
    assert len([b for b in proxy.bodies if b.get("tools")]) == 1  # no step 2 after a refusal
    saved = {r["check"]: r for r in orjson.loads(RunDir(cfg.run_dir).smoke_json.read_bytes())["rows"]}
    assert not saved["agent: agent step 1 request"]["passed"] and "agent: agent step 2 request" not in saved
    assert "(a request carrying `tools`, as every agent step" in saved["agent: agent step 1 request"]["detail"]
    assert saved["chat: request"]["passed"]  # the shape's plain prompt passes: only the tools are refused


async def test_rewritten_call_ids_fail_the_check_naming_the_setting_or_warn_when_kept(tmp_path, capsys):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim, \
            Proxy(sim.base_url, rewrite_ids=True) as proxy:
        cfg = config(tmp_path / "drop", proxy.url)
        code, out = await smoke_exit(cfg, capsys)
        assert code == 1
        assert "FAILED: 21/22 checks passed; failed: agent: agent call ids ('" in out, out
        assert ("' rewrote the call ids ('call_0abc'; the model's own are functions.NAME:IDX): merge would drop every "
                "sample of a step that calls tools") in out, out
        saved = {r["check"]: r for r in orjson.loads(RunDir(cfg.run_dir).smoke_json.read_bytes())["rows"]}
        assert "as foreign_tool_call_id ([validation] drop_foreign_tool_call_ids = true)" in \
            saved["agent: agent call ids"]["detail"]
        assert [c for c, r in saved.items() if not r["passed"]] == ["agent: agent call ids"]
        # Step 2 was still sent, under the provider's id: the tool history itself is accepted.
        step_two = [b for b in proxy.bodies if b.get("tools") and len(b["messages"]) == 3]
        assert step_two and step_two[0]["messages"][2]["tool_call_id"] == "call_0abc"
        cfg = config(tmp_path / "keep", proxy.url, validation={"drop_foreign_tool_call_ids": False})
        result = await run_smoke(cfg, TEST_KEY)
    by = rows(result)
    assert result.passed and by["agent: agent call ids"].warning
    assert "merge keeps those samples, flagged" in by["agent: agent call ids"].detail


async def test_a_run_stops_at_its_smoke_test_when_tools_are_refused_no_dataset_request_sent(tmp_path):
    # `draftgen run` headless, as a user starts it (no smoke.json yet): its smoke test meets the refusal, the
    # run stops there, and the server never saw a dataset's request (the lines' own tools, or their prompts).
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim, \
            Proxy(sim.base_url, refuse_tools=True) as proxy:
        cfg = config(tmp_path, proxy.url)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--interval", "0.5",
            env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    said = " ".join(out.decode().split())
    assert proc.returncode != 0, said
    assert "agent: agent step 1 request (400: HTTP 400: Provider returned error: tools are not supported" in said, said
    assert TEST_KEY not in said and "\x1b[31mhere" not in said
    assert [b["tools"] for b in proxy.bodies if b.get("tools")] == [AGENT_TOOLS]  # the smoke test's, once
    asked = {m["content"] for b in proxy.bodies for m in b["messages"] if m["role"] == "user"}
    assert not any(q.startswith(("Question chat-", "m0:", "m1:", "m2:")) for q in asked), asked
    assert not RunDir(cfg.run_dir).responses("agent").exists() and not RunDir(cfg.run_dir).responses("chat").exists()


async def test_a_self_hosted_server_gets_the_reasoning_back_as_reasoning_content(tmp_path):
    # vLLM and SGLang read an earlier turn's reasoning from `reasoning_content` (the engine's rule,
    # conversations.history_message): step 2 carries it there, never OpenRouter's reasoning_details.
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, sent_log_size=64), port=0) as sim, \
            Proxy(sim.base_url, think=True) as proxy:
        cfg = make_config(tmp_path, proxy.url, datasets(tmp_path), request={"temperature": 0.6},
                          tables={"api": {"kind": "openai-compatible"},
                                  "tokenizer": {"path": str(bundled_kimi_path())}})
        result = await run_smoke(cfg, TEST_KEY)
        sent = [e for e in sim.sent if e.tools]
    by = rows(result)
    assert by["agent: agent step 2 request"].passed and by["agent: agent step 2 prompt tokens"].passed, result.rows
    (call,) = [m for e in sent for m in e.messages if m["role"] == "assistant"]
    assert call["reasoning_content"] == THOUGHT and call["tool_calls"][0]["id"] == "functions.get_time:0"
    assert set(call) == {"role", "content", "tool_calls", "reasoning_content"}


async def test_a_provider_refusing_the_tool_history_fails_step_two_by_name(tmp_path, capsys):
    # Tools accepted, the history with the target's call and its result refused (as a provider that wants
    # reasoning on tool-call turns answers): step 2's row fails with its message, exit 1.
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim, \
            Proxy(sim.base_url, refuse_history=True) as proxy:
        cfg = config(tmp_path, proxy.url)
        code, out = await smoke_exit(cfg, capsys)
    assert code == 1
    assert (f"failed: agent: agent step 2 request (400: HTTP 400: {HISTORY_REFUSAL} (a request carrying the "
            "target's own tool call") in out, out
    saved = {r["check"]: r for r in orjson.loads(RunDir(cfg.run_dir).smoke_json.read_bytes())["rows"]}
    assert saved["agent: agent step 1 request"]["passed"] and saved["agent: agent call ids"]["passed"]
    assert [c for c, r in saved.items() if not r["passed"]] == ["agent: agent step 2 request"]
    assert len([b for b in proxy.bodies if b.get("tools")]) == 2
