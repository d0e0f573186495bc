"""`draftgen demo --headless` end to end: simulator, smoke, run, reconstruction, merge, extraction."""

from __future__ import annotations

import io
import re

import orjson
import pytest

from draftgen.core import provenance
from draftgen.core.config_load import load_config
from draftgen.core.extract import load_sample
from draftgen.core.extract.readback import check_command
from draftgen.core.tokens.store import TokenReader
from draftgen.tui.demo import DEMO_KEY, run_demo
from tests.extract.test_specforge_release import as_specforge_reads, check_run_with_specforge


@pytest.mark.slow
async def test_demo_headless_end_to_end(tmp_path, specforge_tree):
    out = io.StringIO()
    code = await run_demo(tmp_path, headless=True, out=out, latency_scale=0.02)
    text = out.getvalue()
    assert code == 0, text[-3000:]
    run = tmp_path / "run"
    # The chat dataset runs out of its token budget; its two bad lines are rejected, not fatal.
    assert "chat: token budget reached" in text
    assert len((run / "chat" / "rejected.jsonl").read_bytes().splitlines()) == 2
    train = (run / "merged" / "train.jsonl").read_bytes().splitlines()
    tokens = TokenReader(run / "merged" / "tokens")
    assert len(train) == len(tokens) > 200
    stats = orjson.loads((run / "merged" / "stats.json").read_bytes())
    assert stats["dropped"]["duplicate"] >= 1
    files = sorted((run / "hidden_states").rglob("data_*.ckpt"))
    assert len(files) == len(train)
    sample = load_sample(files[0])
    assert set(sample) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert DEMO_KEY not in (run / "events.log").read_text()
    # SpecForge's released reader, loader and EAGLE-3 normaliser accept every file and row the demo wrote
    # (the multi-turn dataset's samples, one per turn, with their hidden states, among them).
    got = check_run_with_specforge(run, specforge_tree)
    # `draftgen check` reads every file back by SpecForge's rules against merged/tokens: all good; and
    # provenance.json says what made merged/, the hidden states and the hand-off.
    checked = io.StringIO()
    assert check_command(load_config(tmp_path / "draftgen.toml"), out=checked) == 0, checked.getvalue()
    assert f"checked {len(train):,} files" in checked.getvalue() and ", 0 bad," in checked.getvalue()
    assert set(provenance.read(run / "merged")) == {"merge"}
    assert set(provenance.read(run / "hidden_states")) == {"extract", "train-command"}
    assert DEMO_KEY not in (run / "hidden_states" / "provenance.json").read_text()
    rows = [orjson.loads(line) for line in train]
    dialogue = check_multi_turn_demo(run, rows, tokens)
    check_agent_demo(run)
    summary = " ".join(text.split())  # its lines wrapped at 120 columns
    assert "agent: counts are turns; 15/20 conversations done, 5 ended early" in summary
    assert "40 answers called tools, 5 conversations diverged (at t2 5)" in summary
    read = {n for n, row in enumerate(rows) if row["id"].startswith("dialogue/")}
    assert len(read) == len(dialogue) and all(got["conversations"][n] == as_specforge_reads(rows[n]["conversations"])
                                              for n in read)


def check_agent_demo(run) -> None:
    """The agent dataset (20 lines, turns = "all"): each step asked once, on the line's tools, the target's
    own earlier calls under their ids and the recorded results under those ids; 15 lines answered in their
    3 steps, the 5 whose second call is not the target's ended at step 2, diverged."""
    from draftgen.tui.demo_agent import TOOLS, diverging
    answered = [orjson.loads(x) for x in (run / "agent" / "responses.jsonl").read_bytes().splitlines()]
    by_id = {r["id"]: r for r in answered}
    assert len(by_id) == len(answered) == 15 * 3 + 5 * 2
    for i in range(20):
        steps = [by_id.get(f"agent-{i}#t{k}") for k in (1, 2, 3)]
        assert [s is not None for s in steps] == [True, True, not diverging(i)]
        assert [bool(s.get("diverged")) for s in steps if s] == ([False, True] if diverging(i) else [False] * 3)
        for k, s in enumerate(steps[1:], 2):
            if s is None:
                continue
            assert s["tools"] == TOOLS and s["tool_results"] == "matched"
            sent = [m for m in s["messages"] if m["role"] in ("assistant", "tool")]
            own = [c for r in steps[:k - 1] for c in r["tool_calls"]]
            assert [c["id"] for m in sent if m["role"] == "assistant" for c in m["tool_calls"]] == \
                [m["tool_call_id"] for m in sent if m["role"] == "tool"] == [c["id"] for c in own]


def check_multi_turn_demo(run, train, tokens) -> set[str]:
    """The dialogue dataset (30 conversations x 3 user turns, turns = "all"): each turn answered once on
    the target's own earlier answers, and one merged sample per answered turn whose ids are the prompt
    the server counted plus the answer, the loss on that answer only; returns the merged turn ids."""
    answered = [orjson.loads(x) for x in (run / "dialogue" / "responses.jsonl").read_bytes().splitlines()]
    by_id = {r["id"]: r for r in answered}
    assert len(by_id) == len(answered) > 80  # each turn once; a turn cut at max_tokens ends its conversation
    for r in answered:
        earlier = [by_id[f"{r['conversation']}#t{j}"]["content"] for j in range(1, r["turn"])]
        assert [m["content"] for m in r["messages"] if m["role"] == "assistant"] == earlier  # the target's own
        assert sum(m["role"] == "user" for m in r["messages"]) == r["turn"]
    report = orjson.loads((run / "dialogue" / "tokens" / "report.json").read_bytes())
    per_turn = report["prompt_token_count_by_turn"]
    assert {k: (v["n"], v["share_exact"]) for k, v in per_turn.items()} == {
        str(k): (sum(r["turn"] == k for r in answered), 1.0) for k in (1, 2, 3)}  # every prompt count exact
    samples = {row["id"].removeprefix("dialogue/"): (row, *tokens.arrays(tokens.entry(row["id"])))
               for row in train if row["id"].startswith("dialogue/")}
    stats = orjson.loads((run / "merged" / "stats.json").read_bytes())
    # by_turn counts every turns = "all" dataset's: the agent dataset's steps too.
    steps = len((run / "agent" / "responses.jsonl").read_bytes().splitlines())
    assert sum(t["read"] for t in stats["by_turn"].values()) == len(answered) + steps
    agent_kept = sum(row["id"].startswith("agent/") for row in train)
    assert len(samples) == sum(t["kept"] for t in stats["by_turn"].values()) - agent_kept > 80
    for turn_id, (row, ids, mask) in samples.items():
        r = by_id[turn_id]
        assert len(ids) == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        assert len(starts) == 1 and mask[-1] and int(mask.sum()) == r["usage"]["completion_tokens"] + 1
        assert sum(m["role"] == "user" for m in row["conversations"]) == r["turn"]
    return set(samples)


@pytest.mark.parametrize("enabled", [False, True], ids=["off", "on"])
def test_the_multi_turn_demo_dataset_is_bundled_and_its_entry_loads_when_switched_on(tmp_path, monkeypatch, enabled):
    """dialogue.jsonl: 30 conversations of 3 user turns; the demo's config lists it (turns = "all") only with
    MULTI_TURN_DEMO on, and carries it commented out otherwise, so the demo runs either way."""
    from draftgen.tui import demo
    monkeypatch.setattr(demo, "MULTI_TURN_DEMO", enabled)
    monkeypatch.setattr(demo, "build_tiny_model", lambda folder: None)  # not needed to read the config
    cfg = demo.prepare(tmp_path, "http://127.0.0.1:9/api/v1")
    names = {d.name: d for d in cfg.datasets}
    assert ("dialogue" in names) is enabled
    assert "# multi-turn demo" in (tmp_path / "draftgen.toml").read_text() or enabled
    lines = [orjson.loads(x) for x in (tmp_path / "prompts" / "dialogue.jsonl").read_bytes().splitlines()]
    users = [sum(t["from"] == "human" for t in line["conversations"]) for line in lines]
    assert users == [3] * 30
    asked = [tuple(t["value"] for t in line["conversations"] if t["from"] in ("system", "human")) for line in lines]
    assert len(set(asked)) == len({line["id"] for line in lines}) == 30  # no conversation a duplicate of another
    if enabled:
        assert (names["dialogue"].turns, names["dialogue"].prompts) == ("all", tmp_path / "prompts/dialogue.jsonl")


def test_the_agent_demo_dataset_is_bundled_as_its_generator_writes_it_and_its_entry_loads(tmp_path, monkeypatch):
    """agent.jsonl: 20 OpenAI-layout agent lines (tools, two tool steps, then an answer), tool call ids in
    Kimi's own shape, each result answering a call of the step before it; the calls are the simulator's
    plan for the task but for 5 lines, whose second call is another (they diverge). The demo's config
    lists it with turns = "all"."""
    from draftgen.simulator.tools import plan
    from draftgen.tui import demo, demo_agent
    monkeypatch.setattr(demo, "build_tiny_model", lambda folder: None)
    cfg = demo.prepare(tmp_path, "http://127.0.0.1:9/api/v1")
    agent = next(d for d in cfg.datasets if d.name == "agent")
    assert (agent.turns, agent.prompts) == ("all", tmp_path / "prompts/agent.jsonl")
    data = (tmp_path / "prompts" / "agent.jsonl").read_bytes()
    assert data == demo_agent.dataset()  # python -m draftgen.tui.demo_agent wrote the bundled file
    lines = [orjson.loads(x) for x in data.splitlines()]
    assert len(lines) == 20 and len({line["id"] for line in lines}) == 20
    diverging = 0
    for i, line in enumerate(lines):
        assert [t["function"]["name"] for t in line["tools"]] == ["search_code", "read_file", "run_tests"]
        msgs = line["messages"]
        steps = [n for n, m in enumerate(msgs) if m["role"] == "assistant"]
        assert len(steps) == 3 and msgs[steps[-1]]["content"] and "tool_calls" not in msgs[steps[-1]]
        for a, b in zip(steps, steps[1:]):
            calls = msgs[a]["tool_calls"]
            assert all(re.fullmatch(rf"functions\.{c['function']['name']}:\d+", c["id"]) for c in calls)
            assert all(isinstance(orjson.loads(c["function"]["arguments"]), dict) for c in calls)
            assert [m["tool_call_id"] for m in msgs[a + 1:b]] == [c["id"] for c in calls]
        first, second = demo_agent.moves(i)  # what the simulator's target calls
        planned = plan(msgs[1]["content"], ["search_code", "read_file", "run_tests"])
        assert [[(c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in r]
                for r in (first, second)] == planned
        assert msgs[steps[0]]["tool_calls"] == first
        assert (msgs[steps[1]]["tool_calls"] != second) is demo_agent.diverging(i)
        diverging += demo_agent.diverging(i)
    assert diverging == 5
