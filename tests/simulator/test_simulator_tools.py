"""The simulator answering with tool calls when a request sends `tools` (simulator/tools.py), over
loopback with a raw aiohttp client: its plan's calls, deterministic, under Kimi's own ids, whole or
streamed alike, and a plain answer after the plan's last round."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.answers import answer_tokenizer
from draftgen.simulator.tools import plan, planned_calls
from tests.helpers import chat_body as body
from tests.helpers import chat_post as post
from tests.helpers import parse_sse

NAMES = ["search", "read_file", "run_tests"]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]


def _streamed(raw: bytes) -> tuple[list[dict[str, Any]], str | None, str]:
    """The calls a stream carried (its pieces joined by index), its finish_reason and its content."""
    chunks, _, done = parse_sse(raw)
    assert done
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or ():
            slot = calls.setdefault(tc["index"], {"function": {"arguments": ""}})
            slot.update({k: tc[k] for k in ("id", "type") if k in tc})
            slot["function"]["name"] = tc["function"].get("name") or slot["function"].get("name")
            slot["function"]["arguments"] += tc["function"].get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return [calls[i] for i in sorted(calls)], finish, content


async def test_tools_sent_are_answered_with_the_plans_calls_under_kimis_ids_whole_or_streamed():
    # Tasks with 0..2 rounds from their hash, and some with "tool rounds: 3": several tools, parallel calls.
    tasks = [f"task {i}" for i in range(24)] + [f"task {i} (tool rounds: 3)" for i in range(4)]
    plans = {t: plan(t, NAMES) for t in tasks}
    assert {len(p) for t, p in plans.items() if "rounds" not in t} == {0, 1, 2}
    assert all(len(plans[t]) == 3 for t in tasks if "rounds" in t)
    assert any(len(r) == 2 for p in plans.values() for r in p)  # parallel calls
    assert len({name for p in plans.values() for r in p for name, _ in r}) == 3
    assert plan("task 1", NAMES) == plans["task 1"] and plan("task 1", []) == []
    tok = answer_tokenizer()
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        async with aiohttp.ClientSession() as s:
            for task in tasks[-6:]:
                messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
                before = 0
                for step in range(len(plans[task]) + 1):
                    expect = planned_calls(messages, TOOLS)
                    assert expect == (plans[task][step] if step < len(plans[task]) else [])
                    status, _, raw = await post(s, sim, body(messages=messages, tools=TOOLS))
                    assert status == 200
                    msg = orjson.loads(raw)["choices"][0]
                    status, _, streamed = await post(s, sim, body(messages=messages, tools=TOOLS, stream=True))
                    calls, finish, content = _streamed(streamed)
                    assert status == 200 and calls == (msg["message"].get("tool_calls") or [])
                    assert finish == msg["finish_reason"] == ("tool_calls" if expect else "stop")
                    assert [(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in calls] == expect
                    ids = [f"functions.{n}:{before + i}" for i, (n, _) in enumerate(expect)]
                    assert [c["id"] for c in calls] == ids  # Kimi's own shape, counted over the conversation
                    assert content == msg["message"]["content"] and (content == "") == bool(expect)
                    usage = orjson.loads(raw)["usage"]
                    assert usage["completion_tokens"] > usage["completion_tokens_details"]["reasoning_tokens"]
                    # the ids a self-hosted server returns are the calls' (or the content's), as billed
                    _, _, with_ids = await post(s, sim, body(messages=messages, tools=TOOLS, return_token_ids=True))
                    ids = orjson.loads(with_ids)["choices"][0]["token_ids"]
                    assert len(ids) == usage["completion_tokens"]
                    _, _, raw_ids = await post(s, sim, body(messages=messages, tools=TOOLS, return_token_ids=True,
                                                            stream=True))
                    chunks, _, _ = parse_sse(raw_ids)
                    assert [i for c in chunks for i in c["choices"][0].get("token_ids") or ()] == ids  # streamed alike
                    if expect:
                        assert ids[-1] == tok.special_id("<|im_end|>") and ids.count(
                            tok.special_id("<|tool_call_begin|>")) == len(expect)
                        assert tok.special_id("<|tool_calls_section_begin|>") in ids
                    before += len(calls)
                    messages += [{"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
                                 *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls)]
                    if not calls:
                        messages.append({"role": "user", "content": "thanks"})
            # No tools sent: never a call.
            status, _, raw = await post(s, sim, body(messages=[{"role": "user", "content": tasks[-1]}]))
            assert status == 200 and "tool_calls" not in orjson.loads(raw)["choices"][0]["message"]


async def test_a_requests_tools_are_counted_in_its_prompt_tokens_as_the_template_declares_them():
    import json

    tok = answer_tokenizer()
    declared = json.dumps(TOOLS, ensure_ascii=False, separators=(",", ":"))  # the template's tojson(',', ':')
    block = 3 + len(tok.encode_text("tool_declare")) + len(tok.encode_text(declared))  # <|im_system|>..<|im_end|>
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        async with aiohttp.ClientSession() as s:
            counts = []
            for tools in (None, TOOLS):
                _, _, raw = await post(s, sim, body(messages=[{"role": "user", "content": "task 0"}],
                                                    **({"tools": tools} if tools else {})))
                counts.append(orjson.loads(raw)["usage"]["prompt_tokens"])
    assert counts[1] - counts[0] == block
