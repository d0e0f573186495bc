"""An agent dataset in the TUI (docs/agents.md): the datasets panel's steps, tool calls and diverged,
and the drill-down's conversation step by step, read from the run directory's responses.jsonl."""

from __future__ import annotations

import orjson
import pytest

from draftgen.core.live import snapshot as snap
from draftgen.tui import demo_agent
from draftgen.tui.app import DraftgenApp
from draftgen.tui.screens.conversation import _read_tail, conversations, read_tail
from tests import fixtures as fx
from tests.helpers import text

pytestmark = pytest.mark.usefixtures("utc")

AGENT_ROW = ("j",) * 5  # the agent dataset is the sixth row of fx.with_agent()


async def agent_drill(pilot) -> str:
    """Open the agent dataset's drill-down; its text."""
    await pilot.press(*AGENT_ROW, "enter")
    return text(pilot.app, "#drill-body")


def make(snapshot: snap.RunSnapshot, run_dir=None) -> DraftgenApp:
    return DraftgenApp(fx.FakeControls(snapshot, fx.events()), title="draftgen", refresh_s=0.05, run_dir=run_dir)


async def test_the_datasets_panel_counts_an_agent_datasets_steps_tool_calls_and_diverged() -> None:
    app = make(fx.with_agent(replayed=4, conversations_ended=6))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        datasets = text(app, "#datasets")
        assert "50/60" in datasets
        assert ("agent: steps 50/60 answered, 40 with tool calls; conversations 10/20 done, 6 ended early "
                "(5 diverged); 4 replayed") in datasets, datasets


async def test_a_multi_turn_dataset_without_tool_calls_still_counts_turns() -> None:
    app = make(fx.with_agent(tool_calls=0, diverged=0, conversations_ended=0))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "agent: turns 50/60 answered; conversations 10/20 done, 0 ended early" in text(app, "#datasets")


async def test_the_drill_down_shows_a_conversation_step_by_step_with_its_calls_and_results(tmp_path) -> None:
    app = make(fx.with_agent(), fx.agent_run_dir(tmp_path))
    async with app.run_test(size=(200, 60)) as pilot:  # wide: no call's line wraps
        body = await agent_drill(pilot)
        assert "conversations     10 of 20 done, 5 ended early (5 diverged)" in body
        assert "tool calls        40 answers called tools (by step: s1 20  s2 20)" in body
        assert "diverged at step  s2 5" in body
        assert "answered by step  s1 20/20  s2 20/20  s3 10/20" in body
        # The newest conversation: its three steps in order, each call's name and arguments, each result
        # under the call id it was sent with.
        assert "conversation agent-0  3 of 3 steps answered" in body
        steps = [body.index(f"step {k} ") for k in (1, 2, 3)]
        assert steps == sorted(steps)
        calls = demo_agent.moves(0)  # one call at step 1, two at once at step 2
        assert [len(c) for c in calls] == [1, 2]
        for k, (start, end) in enumerate(zip(steps, steps[1:])):
            shown = body[start:end]
            for c in calls[k]:
                assert f"→ {c['function']['name']}({c['function']['arguments']})  {c['id']}" in shown
                assert f"← {c['id']}  the dataset's result, sent under the target's call id" in shown
        assert "utils/dates.py:12: def parse_date(value):" in body  # a result, under its call
        assert "    # returns the wrong month for ISO dates" in body
        assert "Fix: use %m, not %M, in the format." in body[steps[2]:]
        # Each step's reasoning: the answer's own, the earlier ones' as their reasoning_details went back.
        assert [body[s:].count("(reasoning: 32 characters)") for s in steps] == [3, 2, 1]
        # [ goes to older conversations: one under way, then one that diverged.
        await pilot.press("left_square_bracket")
        body = text(app, "#drill-body")
        assert "conversation agent-1  2 of 3 steps answered" in body
        assert "diverged" not in body.split("conversation agent-1")[1]
        await pilot.press("left_square_bracket")
        body = text(app, "#drill-body")
        assert "conversation agent-3  2 of 3 steps answered  diverged at step 2" in body
        assert "merge_config replaces nested tables: merge them recursively." in body
        assert "diverged: not the dataset's next move" in body
        await pilot.press("left_square_bracket")  # the oldest read stays
        assert "conversation agent-3" in text(app, "#drill-body")
        await pilot.press("right_square_bracket", "right_square_bracket")
        assert "conversation agent-0  3 of 3 steps answered  (the newest" in text(app, "#drill-body")


async def test_a_conversations_text_is_shown_escaped_never_as_markup_or_controls(tmp_path) -> None:
    """Tool names, arguments, results and answers come from the dataset and the server: their escape
    sequences are shown as escapes and their brackets as text."""
    run = fx.agent_run_dir(tmp_path)
    records = fx.agent_records(2, 2)  # the newest conversation
    records[1]["messages"][-1]["content"] = "\x1b]0;pwned\x07[bold red]not markup[/] \u202eevil"
    records[1]["tool_calls"][0]["function"]["name"] = "read\x1b[2Jfile"
    records[1]["content"] = "[link=https://evil.example]click[/link]"
    with open(run / "agent" / "responses.jsonl", "ab") as f:
        f.write(b"".join(orjson.dumps(r) + b"\n" for r in records))
    app = make(fx.with_agent(), run)
    async with app.run_test(size=(120, 60)) as pilot:
        body = await agent_drill(pilot)
        assert "\\x1b]0;pwned\\x07[bold red]not markup[/] \\u202eevil" in body
        assert "→ read\\x1b[2Jfile(" in body
        assert "[link=https://evil.example]click[/link]" in body
        assert "\x1b" not in body and "\u202e" not in body


async def test_without_a_run_directory_or_for_a_single_turn_dataset_no_conversation_is_shown(tmp_path) -> None:
    app = make(fx.with_agent())
    async with app.run_test(size=(120, 60)) as pilot:
        await pilot.press(*AGENT_ROW, "enter")
        assert "conversation agent" not in text(app, "#drill-body")
    app = make(fx.with_agent(), fx.agent_run_dir(tmp_path))
    async with app.run_test(size=(120, 60)) as pilot:
        await pilot.press("j", "j", "j", "j", "enter")  # B5: single-turn
        body = text(app, "#drill-body")
        assert "dataset B5" in body and "conversation" not in body
    app = make(fx.with_agent(), tmp_path / "empty")
    async with app.run_test(size=(120, 60)) as pilot:
        await pilot.press(*AGENT_ROW, "enter")
        assert "no conversation answered yet" in text(app, "#drill-body")


def test_the_tail_read_leaves_out_the_line_it_cuts_and_a_half_written_last_line(tmp_path) -> None:
    path = tmp_path / "responses.jsonl"
    records = [*fx.agent_records(0, 3), *fx.agent_records(1, 1)]
    data = b"".join(orjson.dumps(r) + b"\n" for r in records)
    torn = b'{"conversation": "agent-2", "tu'
    path.write_bytes(data + torn)
    last_three = len(data) - data.index(b"\n", 0) - 1  # every record but the first, whole
    got = read_tail(path, limit=last_three + len(torn) + 10)  # starts 10 bytes into the first record
    assert [r["id"] for r in got] == ["agent-0#t2", "agent-0#t3", "agent-1#t1"]
    found = conversations(got)
    assert [(c.id, [r["turn"] for r in c.steps]) for c in found] == [("agent-0", [2, 3]), ("agent-1", [1])]
    assert read_tail(tmp_path / "missing.jsonl") == []
    # A tail shorter than the last record is read again, longer, until it holds one.
    last = orjson.dumps(records[-1]) + b"\n"
    short = len(torn) + len(last) // 5
    assert _read_tail(path, short)[0] == [] and read_tail(path, limit=short)[-1]["id"] == "agent-1#t1"


async def test_replayed_results_are_told_apart_from_matched_ones_step_by_step(tmp_path) -> None:
    """tool_results = "replay": the first step whose record says "replayed" after one that did not was
    sent a result after other calls than the dataset's; the results before it were matched."""
    records = fx.agent_records(5, 3)
    records[2]["tool_results"] = "replayed"  # step 3: the results after step 2 were replayed
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "responses.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    app = make(fx.with_agent(replayed=1), tmp_path)
    async with app.run_test(size=(120, 60)) as pilot:
        body = await agent_drill(pilot)
        step2, step3 = body.index("step 2 "), body.index("step 3 ")
        assert "the dataset's result, sent under the target's call id" in body[:step2]
        assert body[step2:step3].count("replayed: the dataset's result after other calls than the dataset's") \
            == len(demo_agent.moves(5)[1])
        assert "replayed results  1 steps sent with a replayed tool result" in body


def test_the_report_counts_an_agent_datasets_steps_tool_calls_and_divergences(tmp_path) -> None:
    """draftgen report reads the same figures from the records alone: steps, answers that called tools,
    conversations diverged (by step), steps sent with a replayed result; a dataset without tools has none."""
    import io

    from draftgen.tui.report import report
    run = fx.agent_run_dir(tmp_path)
    replayed = fx.agent_records(5, 2)
    replayed[1]["tool_results"] = "replayed"
    with open(run / "agent" / "responses.jsonl", "ab") as f:
        f.write(b"".join(orjson.dumps(r) + b"\n" for r in replayed))
    (run / "chat").mkdir()
    (run / "chat" / "responses.jsonl").write_bytes(orjson.dumps({"id": "c1", "content": "hi", "turn": 1}) + b"\n")
    out = io.StringIO()
    report(run, out=out, width=160)
    text = out.getvalue()
    assert ("agent: 9 agent steps answered, 7 called tools, 1 conversations diverged (at step 2: 1), "
            "1 steps sent with a replayed tool result") in text, text
    assert "chat:" not in text
