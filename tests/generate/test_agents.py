"""Agent lines (OpenAI layout: `tools`, assistant `tool_calls`, `tool` results) regenerated with
turns = "all" against the simulator on 127.0.0.1, headless as a user runs it: every step asked once, in
order, each request carrying the line's tools, the target's own earlier messages (its calls under its own
`functions.NAME:IDX` ids) and the dataset's recorded results under those ids; a trajectory whose recorded
call is not the target's ends after that step, counted diverged; kill -9 at any step resumes at the next,
nothing asked twice beyond what was in flight. What each request carried is the simulator's log
(`SimServer.sent`); the simulator's calls are its plan (simulator/tools.py `plan`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest

from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.stats import prompt_key
from draftgen.simulator.tools import plan
from tests.generate.test_multiturn import kill_loop, records, run_to_end, write_conversations
from tests.helpers import make_config

NAMES = ["search", "read_file", "edit_file"]
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} in the repository",
                                           "parameters": {"type": "object", "properties": {}}}} for n in NAMES]


def trajectory(cid: str, rounds: int, *, diverge_at: int | None = None) -> dict[str, Any]:
    """An agent line whose recorded calls are the simulator's plan for its task (`rounds` tool steps, then
    an answer), the dataset's own ids `call_<cid>_<k>`; `diverge_at`: that step's recorded call carries
    other arguments than the target will send."""
    task = f"{cid}: fix the failing test (tool rounds: {rounds})"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": task}]
    for k, calls in enumerate(plan(task, NAMES), 1):
        recorded = [(name, {**args, "query": "SOMETHING ELSE"} if k == diverge_at else args) for name, args in calls]
        ids = [f"call_{cid}_{k}_{i}" for i in range(len(calls))]
        messages.append({"role": "assistant", "content": f"DATASET step {k}", "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
            for i, (name, args) in zip(ids, recorded, strict=True)]})
        messages += [{"role": "tool", "tool_call_id": i, "content": f"RESULT of {cid} step {k} call {j}"}
                     for j, i in enumerate(ids)]
    messages.append({"role": "assistant", "content": f"DATASET final answer of {cid}"})
    return {"id": cid, "tools": TOOLS, "messages": messages}


def assert_own_steps(sent: Any, answered: list[dict[str, Any]]) -> int:
    """Every request carried the line's tools; every assistant message it carried is the target's stored
    answer to the request made of the messages before it (content, its calls with its own ids, its
    reasoning_details as returned), and every tool result after it is the dataset's recorded result for
    that call, under the target's own id. Returns how many tool results were sent."""
    answers = {prompt_key(r["messages"]): r for r in answered}
    results = 0
    for e in sent:
        assert e.tools == TOOLS
        msgs = e.messages
        calls: list[str] = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                earlier = answers.get(prompt_key(msgs[:i]))
                assert earlier is not None, f"a history message the target never gave: {m!r:.200}"
                assert m == {"role": "assistant", "content": earlier["content"], "tool_calls": earlier["tool_calls"],
                             "reasoning_details": earlier["reasoning_details"]}
                assert "DATASET" not in m["content"] and earlier["tool_calls"]
                assert all(c["id"].startswith("functions.") for c in earlier["tool_calls"])
                calls = [c["id"] for c in earlier["tool_calls"]]
            elif m["role"] == "tool":
                conv, k = earlier["conversation"], earlier["turn"]
                j = calls.index(m["tool_call_id"])  # the target's own id of the call it answers
                assert m == {"role": "tool", "tool_call_id": calls[j], "content": f"RESULT of {conv} step {k} call {j}"}
                results += 1
    return results


async def test_forty_trajectories_each_step_asked_once_with_the_recorded_results_ten_diverge(tmp_path):
    lines = [trajectory(f"m{i}", 2) for i in range(30)] + [trajectory(f"d{i}", 2, diverge_at=2) for i in range(10)]
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", lines)
    async with SimServer(SimConfig(seed=4, latency_scale=0.02, mean_completion_tokens=60, sent_log_size=10_000),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                                    "concurrency": 8, "max_tokens": 2048}],
                          tables={"api": {"stream": True}, "engine": {"reconstruct": False},
                                  "budget": {"max_usd": 5.0}})
        text, report, billed, log = await run_to_end(cfg, sim)
    lines_out = records(RunDir(cfg.run_dir).responses("agent"))
    ids = sorted(r["id"] for r in lines_out)
    assert ids == sorted([f"m{i}#t{k}" for i in range(30) for k in (1, 2, 3)]
                         + [f"d{i}#t{k}" for i in range(10) for k in (1, 2)])  # diverging: 2 steps and no more
    assert len(log) == 110 and set(Counter(prompt_key(e.messages) for e in log).values()) == {1}  # each once
    assert assert_own_steps(log, lines_out) > 0
    for r in lines_out:  # a step carries a result for every call of the target's earlier steps
        earlier = [x for x in lines_out if x["conversation"] == r["conversation"] and x["turn"] < r["turn"]]
        assert sum(m["role"] == "tool" for m in r["messages"]) == sum(len(x["tool_calls"]) for x in earlier)
    assert sorted(r["id"] for r in lines_out if r.get("diverged")) == sorted(f"d{i}#t2" for i in range(10))
    for r in lines_out:
        assert r["tools"] == TOOLS and r["turns"] == 3
        assert r.get("tool_results") == (None if r["turn"] == 1 else "matched")
        assert bool(r["tool_calls"]) == (r["turn"] < 3) and r["finish_reason"] == ("tool_calls" if r["turn"] < 3
                                                                                   else "stop")
        assert not r["empty_content"] and not r["truncated"]
    assert report.reconciliation.total_usd == pytest.approx(billed, abs=1e-6)  # ledger = bill
    assert "110/120" in text, text[-2000:]
    summary = " ".join(text.split())  # the lines wrapped, as one
    assert "10 ended early: 10 diverged" in summary, text[-3000:]
    assert "80 answers called tools, 10 conversations diverged (at t2 10)" in summary, text[-3000:]


@pytest.mark.slow
async def test_kill_9_at_any_step_of_agent_trajectories_resumes_at_the_next_step_none_asked_twice(tmp_path):
    n_conv, n_steps = 24, 4
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl",
                                  [trajectory(f"c{i}", n_steps - 1) for i in range(n_conv)])
    cfg, log = await kill_loop(tmp_path, "agent", prompts, (10, 35, 65), n_conv * n_steps)
    lines = records(RunDir(cfg.run_dir).responses("agent"))
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)) == n_conv * n_steps  # every step answered, none twice, none lost
    assert not any(r.get("diverged") for r in lines)
    assert assert_own_steps(log, lines) >= n_conv * (n_steps - 1)
    for r in lines:  # a stored step's history is the stored answers of its conversation, in order
        earlier = {x["turn"]: x for x in lines if x["conversation"] == r["conversation"] and x["turn"] < r["turn"]}
        sent = [m for m in r["messages"] if m["role"] == "assistant"]
        assert [m["tool_calls"] for m in sent] == [earlier[k]["tool_calls"] for k in sorted(earlier)]
