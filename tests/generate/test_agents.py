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

from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.stats import prompt_key
from draftgen.simulator.tools import plan
from tests.generate.test_multiturn import kill_loop, records, run_engine, run_to_end, write_conversations
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


def test_a_steps_reservation_is_the_worst_case_of_the_body_sent_its_tools_and_history_included(tmp_path):
    from types import SimpleNamespace

    from draftgen.core.generate.api.prices import Prices, body_worst_case
    from draftgen.core.generate.loop.prompts import parse_conversation
    from draftgen.core.generate.loop.room import Room
    from draftgen.core.records import TurnFields

    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "agent", "n": 1, "turns": "all",
                                                               "max_tokens": 500}])
    prices = {"agent": Prices(5e-7, 2e-6, 0.0, "config")}
    parts = SimpleNamespace(money=None, book=None, datasets={}, opened=SimpleNamespace(
        costs=SimpleNamespace(settler=None, prices=prices)))
    room = Room(SimpleNamespace(config=cfg, control=None, event=None), parts, None)  # type: ignore[arg-type]
    conv = parse_conversation(trajectory("c", 2))
    history = [{"role": "user", "content": "c: fix the failing test (tool rounds: 2)"},
               {"role": "assistant", "content": "", "reasoning_details": [{"type": "reasoning.text", "text": "t"}],
                "tool_calls": [{"id": "functions.search:0", "type": "function",
                                "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
               {"role": "tool", "tool_call_id": "functions.search:0", "content": "RESULT " * 50}]
    step = Prompt("c#t2", history, 1, TurnFields("c", 2, 3, conv.fingerprint[1], agent=True, tools=conv.tools))
    d = cfg.datasets[0]
    body, worst = room.request_for(SimpleNamespace(config=d), step)  # type: ignore[arg-type]
    assert body["tools"] == TOOLS and body["messages"] is history
    assert worst == pytest.approx(body_worst_case(prices["agent"], body, d.max_tokens))
    without = {**body}
    del without["tools"]
    assert worst > body_worst_case(prices["agent"], without, d.max_tokens)  # the tools are counted


async def test_max_usd_holds_over_agent_steps_and_ends_a_trajectory_at_the_step_it_has_no_room_for(tmp_path):
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", [trajectory(f"c{i}", 2) for i in range(6)])
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40, length_sigma=0.0,
                                   sent_log_size=10_000), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                                    "concurrency": 1, "max_tokens": 2048}],
                          tables={"engine": {"reconstruct": False}, "budget": {"max_usd": 0.0075}})
        engine, _state, events = await run_engine(cfg)
        log = sim.sent
        billed = sim.stats.billed_usd
    lines = records(RunDir(cfg.run_dir).responses("agent"))
    assert len(log) == len(lines) and 0 < len(lines) < 18  # every step asked was answered; max_usd stopped the rest
    assert billed <= 0.0075
    answered: dict[str, set[int]] = {}
    for r in lines:
        answered.setdefault(r["conversation"], set()).add(r["turn"])
    assert all(ks == set(range(1, len(ks) + 1)) for ks in answered.values())  # each trajectory: steps 1..j
    row = next(x for x in engine.snapshot().datasets if x.name == "agent")
    assert (row.done, row.skipped, row.total) == (len(lines), 18 - len(lines), 18) and not row.diverged
    assert any("skipped for max_usd" in msg for _, msg in events), events


async def test_the_snapshot_and_headless_lines_count_tool_calls_diverged_by_step_and_replayed(tmp_path):
    from draftgen.core.merge.merge import merge
    from draftgen.headless.printer import detail_lines

    lines = [trajectory("m0", 2), trajectory("m1", 2), trajectory("d0", 2, diverge_at=2),
             trajectory("d1", 2, diverge_at=1)]
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", lines)
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40, sent_log_size=1000),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [
            {"name": "match", "prompts": prompts, "turns": "all", "concurrency": 2},
            {"name": "replay", "prompts": prompts, "turns": "all", "concurrency": 2, "tool_results": "replay"}],
                          tables={"engine": {"skip_cross_dataset_duplicates": False, "reconstruct": False}})
        engine, _state, _events = await run_engine(cfg)
    s = engine.snapshot()
    match, replay = (next(d for d in s.datasets if d.name == n) for n in ("match", "replay"))
    assert (match.done, match.skipped, match.diverged, match.replayed) == (2 * 3 + 2 + 1, 3, 2, 0)
    assert match.diverged_by_number == (1, 1, 0) and match.tool_calls_by_number == (4, 3, 0)
    assert match.tool_calls == 7
    # replay: every recorded result spliced after the target's calls (as many of them): all 12 steps asked
    assert (replay.done, replay.skipped, replay.diverged, replay.replayed) == (12, 0, 0, 3)
    stored = records(RunDir(cfg.run_dir).responses("replay"))
    assert sorted(r["id"] for r in stored if r.get("tool_results") == "replayed") == ["d0#t3", "d1#t2", "d1#t3"]
    text = "\n".join(detail_lines(s))  # both done: the last dataset of the config is shown
    assert "12/12 turns (4/4 conversations done, 0 ended early, 8 tool calls, 0 diverged, 3 replayed)" in text, text
    # merge's stats count them by step too (every line read, kept or not)
    stats = merge(cfg)
    by_ds = {d.name: d.by_turn for d in stats.datasets}
    assert [row.get("diverged", 0) for row in by_ds["match"].values()] == [1, 1, 0]
    assert [row.get("replayed", 0) for row in by_ds["replay"].values()] == [0, 1, 2]
    assert stats.to_json_dict()["by_turn"]["2"]["diverged"] == 1


async def test_an_answer_cut_at_max_tokens_ends_its_trajectory_as_cut_not_diverged(tmp_path):
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", [trajectory(f"c{i}", 2) for i in range(3)])
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=200, length_sigma=0.0),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                                    "max_tokens": 20}], tables={"engine": {"reconstruct": False}})
        engine, _state, _events = await run_engine(cfg)
    stored = records(RunDir(cfg.run_dir).responses("agent"))
    assert sorted(r["id"] for r in stored) == ["c0#t1", "c1#t1", "c2#t1"]
    assert all(r["truncated"] and not r["tool_calls"] and "diverged" not in r for r in stored)
    row = next(d for d in engine.snapshot().datasets if d.name == "agent")
    assert (row.diverged, row.conversations_ended, row.skipped) == (0, 3, 6)


def test_tool_results_is_match_or_replay_and_for_turns_all_only(tmp_path):
    from draftgen.core.config_load import config_from_dict
    from draftgen.core.errors import ConfigError

    def load(**ds: Any) -> Any:
        raw = {"output": {"dir": "run"}, "datasets": [{"name": "agent", "prompts": "agent.jsonl", **ds}]}
        return config_from_dict(raw, tmp_path / "draftgen.toml")

    (tmp_path / "agent.jsonl").write_bytes(orjson.dumps(trajectory("c", 1)) + b"\n")
    assert load(turns="all").datasets[0].tool_results == "match"
    assert load(turns="all", tool_results="replay").datasets[0].tool_results == "replay"
    with pytest.raises(ConfigError, match=r"draftgen.toml: datasets\[0\].tool_results = 'replay' \(dataset agent\)"
                                          r".*turns is 'last' \(the default\)"):
        load(tool_results="replay")
    with pytest.raises(ConfigError, match="tool_results"):
        load(turns="all", tool_results="run")


def test_the_prompt_bound_counts_tools_as_the_template_renders_them_quotes_escaped():
    import json

    from draftgen.core.generate.api.prices import body_prompt_bound, prompt_token_bound

    quoted = [{"type": "function", "function": {"name": "q", "description": '"' * 400 + "é" * 50,
                                                "parameters": {"type": "object"}}}]
    rendered = len(json.dumps(quoted, ensure_ascii=False).encode())  # what tojson writes: 800 bytes of quotes
    assert body_prompt_bound({"messages": [], "tools": quoted}) - prompt_token_bound(()) >= rendered


async def test_agent_steps_reconstruct_exactly_each_count_equal_to_the_simulators_bill(tmp_path):
    # What the run stores for each step (its tools, its history with the target's calls and the recorded
    # results, its own calls) renders as Kimi-K2.5's template does (core/tokens): every check passes, and
    # the prompt and answer counts equal what the simulator billed, which renders the tools declared and the
    # calls on its own (simulator/prompt.py, tools.py).
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    from draftgen.core.tokens.workers import reconstruct_dataset

    lines = [trajectory(f"m{i}", 2) for i in range(6)] + [trajectory("d0", 2, diverge_at=2)]
    prompts = write_conversations(tmp_path / "prompts" / "agent.jsonl", lines)
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "agent", "prompts": prompts, "turns": "all",
                                                    "concurrency": 4}],
                          tables={"api": {"stream": True}, "tokenizer": {"path": str(bundled_kimi_path())}})
        await run_engine(cfg)
    report = reconstruct_dataset(cfg, "agent", workers=1)
    assert (report.checked, report.valid) == (20, 20) and not any(report.failures.values())
    assert report.diffs == {0: 20} and report.prompt_diffs == {0: 20}
    assert sum(a.tool_answers for a in report.providers.values()) == 14  # 6 x 2 + d0's 2 (its second diverged)
