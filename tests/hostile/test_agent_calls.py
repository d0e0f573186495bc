"""A hostile server's tool calls on an agent line's steps (issue 52): calls whose arguments orjson reads
but cannot write back (nested deeper than 254 levels), whole or streamed, are stored, judged against the
dataset's calls and sent back in the next step's history; no answer paid for is lost to an error of the
engine's own. The server is a small aiohttp server of this file's own on 127.0.0.1 (test_money_checks'
HostileServer answering with the calls each test gives)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from draftgen.core.rundir import RunDir
from tests.generate.test_multiturn import records, run_engine, write_conversations
from tests.helpers import make_config
from tests.hostile.test_money_checks import MAX_TOKENS, TRUE_COST, HostileServer, honest_usage

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
DEEP = '{"q": ' + "[" * 300 + "]" * 300 + "}"  # orjson reads 1,024 levels and writes 254


class ToolServer(HostileServer):
    """Answers a request with `calls(body)` as its tool calls (finish_reason tool_calls), or a plain answer
    when that is None; keeps every body it was sent."""

    def __init__(self, calls: Callable[[dict[str, Any]], list[Any] | None]) -> None:
        super().__init__()
        self.calls = calls
        self.bodies: list[dict[str, Any]] = []

    async def billed_request(self, request: web.Request) -> tuple[dict[str, Any], int]:
        """The request's body (kept) and its answer's number, billed TRUE_COST."""
        body = await request.json()
        self.bodies.append(body)
        self.answers += 1
        self.billed += TRUE_COST
        return body, self.answers

    async def chat(self, request: web.Request) -> web.Response:
        body, n = await self.billed_request(request)
        calls = self.calls(body)
        message: dict[str, Any] = {"role": "assistant", "content": "" if calls else f"Answer {n}.",
                                   "reasoning": "Think."}
        if calls:
            message["tool_calls"] = calls
        answer = {"id": f"gen-{n}", "model": "moonshotai/kimi-k2.5", "provider": "Hostile",
                  "object": "chat.completion", "usage": honest_usage(),
                  "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": message}]}
        return web.Response(body=orjson.dumps(answer), content_type="application/json",
                            headers={"X-Generation-Id": f"gen-{n}"})


def agent_line(cid: str, arguments: str) -> dict[str, Any]:
    """A user turn, the dataset's call of `search` with these arguments, its result, a final answer."""
    return {"id": cid, "tools": TOOLS, "messages": [
        {"role": "user", "content": f"task {cid}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"RESULT of {cid}"},
        {"role": "assistant", "content": "done"}]}


def stored_cleanly(cfg: Any, state: Any, events: list[Any]) -> dict[str, dict[str, Any]]:
    """The run ended DONE with no engine error and no failure: its stored answers by id."""
    assert str(state) == "DONE", events
    assert not [e for e in events if "engine's own error" in e[1]], events
    rd = RunDir(cfg.run_dir)
    assert not records(rd.failures("agent"))
    return {r["id"]: r for r in records(rd.responses("agent"))}


async def test_deeply_nested_call_arguments_are_stored_judged_and_sent_back_never_an_engine_error(tmp_path: Path):
    # The target calls `search` with DEEP on its first step. Line m recorded the same call (matched: its
    # result is sent after it, step 2 asked); line d recorded another (diverged, kept, nothing more asked).
    first = [{"id": "functions.search:0", "type": "function", "function": {"name": "search", "arguments": DEEP}}]
    async with ToolServer(lambda body: first if len(body["messages"]) == 1 else None) as srv:
        prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl",
                                      [agent_line("m", DEEP), agent_line("d", '{"q": "other"}')])
        cfg = make_config(tmp_path, srv.url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                               "concurrency": 2, "max_tokens": MAX_TOKENS}],
                          tables={"engine": {"reconstruct": False}, "budget": {"max_usd": 1.0}})
        _engine, state, events = await run_engine(cfg)
    lines = stored_cleanly(cfg, state, events)
    assert sorted(lines) == ["d#t1", "m#t1", "m#t2"]  # every answer paid for is stored
    assert lines["m#t1"]["tool_calls"] == first and not lines["m#t1"].get("diverged")
    assert lines["d#t1"]["diverged"] is True
    assert lines["m#t2"]["tool_results"] == "matched"
    sent = next(b for b in srv.bodies if len(b["messages"]) > 1)["messages"]
    assert sent[1]["tool_calls"] == first  # the target's own call, its argument text as it gave it
    assert sent[2] == {"role": "tool", "tool_call_id": "functions.search:0", "content": "RESULT of m"}
    assert srv.answers == 3


class StreamingToolServer(ToolServer):
    """ToolServer's answers streamed: `calls(body)` are the tool-call deltas, one chunk each."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, n = await self.billed_request(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Generation-Id": f"gen-{n}"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            c: dict[str, Any] = {"id": f"gen-{n}", "model": "moonshotai/kimi-k2.5", "provider": "Hostile",
                                 "object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if finish:
                c["usage"] = honest_usage()
            return b"data: " + orjson.dumps(c) + b"\n\n"

        await resp.write(chunk({"role": "assistant", "reasoning": "Think."}))
        deltas = self.calls(body)
        for d in deltas or ():
            await resp.write(chunk({"tool_calls": [d]}))
        await resp.write(chunk({}, "tool_calls") if deltas else chunk({"content": f"Answer {n}."}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def test_odd_streamed_tool_call_deltas_are_assembled_or_end_the_step_never_an_engine_error(tmp_path: Path):
    call = {"index": 0, "id": "functions.search:0", "type": "function"}
    deltas: dict[str, list[Any]] = {
        "object": [{**call, "function": {"name": "search", "arguments": {"q": 1}}}],  # arguments as an object
        "index": [{**call, "index": "x", "function": {"name": "search", "arguments": '{"q": 1}'}}],
        "junk": ["junk", {**call, "function": {"name": "search", "arguments": '{"q": 1}'}}],  # a delta not a call's
        "function": [{**call, "function": "junk"}],  # no name: the step ends there
    }
    async with StreamingToolServer(lambda body: deltas[body["messages"][0]["content"].removeprefix("task ")]
                                   if len(body["messages"]) == 1 else None) as srv:
        prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl",
                                      [agent_line(cid, '{"q": 1}') for cid in deltas])
        cfg = make_config(tmp_path, srv.url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                               "concurrency": 4, "max_tokens": MAX_TOKENS}],
                          tables={"api": {"stream": True}, "engine": {"reconstruct": False},
                                  "budget": {"max_usd": 1.0}})
        _engine, state, events = await run_engine(cfg)
    lines = stored_cleanly(cfg, state, events)
    assert sorted(lines) == ["function#t1", "index#t1", "index#t2", "junk#t1", "junk#t2", "object#t1", "object#t2"]
    for cid in ("object", "index", "junk"):  # assembled: the dataset's call, its result sent, step 2 asked
        assert lines[f"{cid}#t1"]["tool_calls"] == [{**{k: v for k, v in call.items() if k != "index"}, "function": {
            "name": "search", "arguments": '{"q":1}' if cid == "object" else '{"q": 1}'}}]
        assert lines[f"{cid}#t2"]["tool_results"] == "matched"
    assert any("conversation 'function' ended at turn 1 of 2: a tool call with no name or id" in e[1] for e in events)
    assert srv.answers == 7


async def test_arguments_are_compared_exactly_integers_past_64_bits_included(tmp_path: Path) -> None:
    # The target calls with an integer past 64 bits; line "same" recorded it written otherwise (matched),
    # "other" recorded the next integer (orjson reads both as the same float: it was matched, the dataset's
    # result sent after a call it did not answer), "inf" recorded 1e400 where the target sent null.
    big = 2 ** 64
    first = {"same": f'{{"id": {big}, "q": "x"}}', "other": f'{{"id": {big}, "q": "x"}}', "inf": '{"id": null}'}
    recorded = {"same": f'{{"q":"x","id":{big}}}', "other": f'{{"id": {big + 1}, "q": "x"}}', "inf": '{"id": 1e400}'}

    def calls(body: dict[str, Any]) -> list[Any] | None:
        if len(body["messages"]) > 1:
            return None
        cid = body["messages"][0]["content"].removeprefix("task ")
        return [{"id": "functions.search:0", "type": "function",
                 "function": {"name": "search", "arguments": first[cid]}}]
    async with ToolServer(calls) as srv:
        prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl",
                                      [agent_line(cid, args) for cid, args in recorded.items()])
        cfg = make_config(tmp_path, srv.url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                               "concurrency": 3, "max_tokens": MAX_TOKENS}],
                          tables={"engine": {"reconstruct": False}, "budget": {"max_usd": 1.0}})
        _engine, state, events = await run_engine(cfg)
    assert str(state) == "DONE", events
    lines = {r["id"]: r for r in records(RunDir(cfg.run_dir).responses("agent"))}
    assert sorted(lines) == ["inf#t1", "other#t1", "same#t1", "same#t2"]
    assert lines["same#t2"]["tool_results"] == "matched"
    assert lines["other#t1"]["diverged"] is True and lines["inf#t1"]["diverged"] is True
