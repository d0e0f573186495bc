"""A turns = "all" dataset's prompt source (core/generate/loop/conversations.py), driven directly: each
conversation's user turns in order, on the target's own answers, one turn in flight per conversation,
broken turns ending their conversation, resume and edit detection from the records on disk."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.config_tables import DatasetConfig
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.generate.loop.conversations import ConversationSource, history_message
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.prompt_files import read_conversations, read_prompts
from draftgen.core.generate.loop.prompts import Conversation, Prompt, Rejection, parse_conversation
from draftgen.core.generate.loop.source import Booked, BookedAs
from draftgen.core.generate.money.budget import TokenBudget
from draftgen.core.records import FailureRecord, ResponseRecord, TurnFields, Usage
from draftgen.core.server_kinds import OpenAICompatible, OpenRouter
from draftgen.core.servers import ServerProfile

OPENROUTER, SELF_HOSTED = ServerProfile(OpenRouter()), ServerProfile(OpenAICompatible())


def _conv(cid: str, n: int, *, system: str | None = None, tool_after: int | None = None) -> dict[str, Any]:
    turns: list[dict[str, Any]] = [{"from": "system", "value": system}] if system else []
    for k in range(1, n + 1):
        turns.append({"from": "human", "value": f"{cid} user turn {k}"})
        if tool_after == k:
            turns.append({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                               "function": {"name": "f"}}]})
            turns.append({"role": "tool", "content": "result"})
        turns.append({"from": "gpt", "value": f"DATASET answer {k} of {cid}"})
    return {"id": cid, "conversations": turns}


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def _answer(text: str, *, finish: str = "stop", tool_calls: list[Any] | None = None) -> ChatAnswer:
    return ChatAnswer(content=text, reasoning=f"thinking about {text}", tool_calls=tool_calls, finish_reason=finish,
                      native_finish_reason=finish, provider="P", model="m", generation_id="g", usage=Usage(10, 5, 2),
                      latency_s=0.1,
                      reasoning_details=[{"type": "reasoning.text", "text": f"thinking about {text}", "index": 0}])


def _dataset(tmp_path: Path, prompts: Path) -> DatasetRun:
    cfg = DatasetConfig(name="chat", prompts=prompts, turns="all")
    ds = DatasetRun(cfg, TokenBudget(None, cfg.max_tokens), AdaptiveConcurrency(cfg.concurrency))
    return ds


def _source(tmp_path: Path, ds: DatasetRun, *, events: list[str] | None = None,
            max_turns: int | None = None) -> ConversationSource:
    sink = events if events is not None else []
    return ConversationSource(ds, server=OPENROUTER, responses=tmp_path / "responses.jsonl",
                              failures=tmp_path / "failures.jsonl", max_turns=max_turns,
                              on_event=lambda p: sink.append(p.text()))


def _count(ds: DatasetRun, path: Path, max_turns: int | None = None) -> None:
    convs = [c for c in read_conversations(path, max_turns) if isinstance(c, Conversation)]
    total = sum(c.turns for c in convs)
    fresh = sum(f"{c.id}#t{k}" not in ds.done_ids for c in convs for k in range(1, c.turns + 1))
    ds.counted(total, 0, fresh)
    ds.conversations.total = len(convs)


async def _drive(src: ConversationSource, ds: DatasetRun, answer: Any, responses: Path | None = None,
                 stop_after: int | None = None, concurrency: int = 3) -> list[Prompt]:
    """Ask every turn the source yields, `concurrency` at a time (taken before any is booked),
    `answer(prompt)` its Booked; each answered turn written to `responses` as the record book writes
    it. Stops after `stop_after` bookings."""
    asked: list[Prompt] = []
    booked = 0
    while True:
        batch: list[Prompt] = []
        while True:
            if src.would_wait or len(batch) >= concurrency:
                break
            try:  # next() waits once every open conversation has its turn out: cancelled, nothing lost
                p = await asyncio.wait_for(src.next(), 0.3 if batch else 5)
            except TimeoutError:
                break
            if p is None:
                break
            batch.append(p)
        if not batch:
            return asked
        conversations = [p.turn.conversation for p in batch if p.turn is not None]
        assert len(conversations) == len(set(conversations)), "two turns of one conversation in flight"
        for p in batch:
            asked.append(p)
            result = answer(p)
            if result.kind is BookedAs.ANSWERED:
                a = result.answer
                empty = not a.content.strip() and not a.tool_calls  # as record_book.record_answer
                diverged = p.turn is not None and p.turn.diverges(a.tool_calls)  # (answers here are never broken)
                ds.answered(p.id, 5, 0.0, short=a.finish_reason == "length" or empty, calls=bool(a.tool_calls),
                            diverged=diverged)
                if responses is not None:
                    rec = ResponseRecord(id=p.id, messages=p.messages, reasoning=a.reasoning, content=a.content,
                                         tool_calls=a.tool_calls, finish_reason=a.finish_reason,
                                         native_finish_reason=None, provider="P", model="m", generation_id="g",
                                         usage=a.usage, latency_s=0.1, attempts=1,
                                         truncated=a.finish_reason == "length",
                                         empty_content=empty, ts=1.0, turn=p.turn,
                                         reasoning_details=a.reasoning_details)
                    with open(responses, "ab") as f:
                        f.write(orjson.dumps({**rec.to_dict(), **({"diverged": True} if diverged else {})}) + b"\n")
            elif result.kind is BookedAs.FAILED:
                ds.failed_one(p.id)
            elif result.kind is BookedAs.SKIPPED:
                ds.skipped_some()
            src.booked(p, result)
            booked += 1
            if stop_after is not None and booked >= stop_after:
                return asked


def _own(p: Prompt) -> Booked:
    return Booked(BookedAs.ANSWERED, _answer(f"OWN answer to {p.id}"))


async def test_every_turn_is_asked_once_in_order_on_the_targets_own_answers(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conv(f"c{i}", 3, system="Be brief." if i == 0 else None)
                                            for i in range(5)])
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    src = _source(tmp_path, ds)
    asked = await _drive(src, ds, _own)
    assert sorted(p.id for p in asked) == sorted(f"c{i}#t{k}" for i in range(5) for k in (1, 2, 3))
    for p in asked:
        assert p.turn is not None
        k = p.turn.turn
        roles = [m["role"] for m in p.messages]
        assert roles[-1] == "user" and roles.count("user") == k and roles.count("assistant") == k - 1
        assert p.messages[-1]["content"] == f"{p.turn.conversation} user turn {k}"
        history = [m for m in p.messages if m["role"] == "assistant"]
        assert not any("DATASET" in m["content"] for m in p.messages)  # never the dataset's answers
        for j, m in enumerate(history, start=1):
            own = f"OWN answer to {p.turn.conversation}#t{j}"
            assert m == {"role": "assistant", "content": own,
                         "reasoning_details": [{"type": "reasoning.text", "text": f"thinking about {own}", "index": 0}]}
    assert asked[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert ds.done == ds.total == 15 and ds.left == 0
    assert ds.conversations.done == 5 and ds.conversations.ended == 0


def test_history_is_sent_as_each_api_documents_it():
    assert history_message("a", "r", [{"type": "reasoning.text", "text": "r"}], server=OPENROUTER) == {
        "role": "assistant", "content": "a", "reasoning_details": [{"type": "reasoning.text", "text": "r"}]}
    assert history_message("a", "r", None, server=OPENROUTER) == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert history_message("a", "r", [{"type": "x"}], server=SELF_HOSTED) == {
        "role": "assistant", "content": "a", "reasoning_content": "r"}
    assert history_message("a", None, None, server=SELF_HOSTED) == {"role": "assistant", "content": "a"}
    # An agent step's calls go back as the target made them (its id, its argument text, not re-serialised),
    # a stream's assembled call (no "type", keys in another order) in the OpenAI shape.
    streamed = [{"function": {"arguments": '{ "q":"x" }', "name": "search"}, "id": "functions.search:0"}]
    call = {"id": "functions.search:0", "type": "function", "function": {"name": "search", "arguments": '{ "q":"x" }'}}
    assert history_message("", "r", None, server=SELF_HOSTED, tool_calls=streamed) == {
        "role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "r"}
    assert history_message("", "r", [{"type": "x"}], server=OPENROUTER, tool_calls=[call]) == {
        "role": "assistant", "content": "", "tool_calls": [call], "reasoning_details": [{"type": "x"}]}


@pytest.mark.parametrize(("why", "result"), [
    ("cut at max_tokens", Booked(BookedAs.ANSWERED, _answer("half", finish="length"))),
    ("empty answer", Booked(BookedAs.ANSWERED, _answer("  "))),
    ("answered with tool calls", Booked(BookedAs.ANSWERED, _answer("x", tool_calls=[{"id": "1"}]))),
    ("failed", Booked(BookedAs.FAILED, reason="400_invalid_prompt")),
    ("skipped", Booked(BookedAs.SKIPPED, reason="max_usd")),
])
async def test_a_broken_turn_ends_its_conversation_and_its_rest_is_counted_skipped(tmp_path, why, result):
    path = _write(tmp_path / "chat.jsonl", [_conv("a", 4), _conv("b", 4)])
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    events: list[str] = []
    src = _source(tmp_path, ds, events=events)
    asked = await _drive(src, ds, lambda p: result if p.id == "a#t2" else _own(p))
    ids = {p.id for p in asked}
    assert "a#t3" not in ids and "a#t4" not in ids  # nothing asked on a broken answer
    assert {f"b#t{k}" for k in (1, 2, 3, 4)} <= ids
    assert ds.skipped == 2 + (why == "skipped") and ds.left == 0
    assert ds.conversations.ended == 1 and ds.conversations.done == 1
    assert any(f"ended at turn 2 of 4: {why}" in e for e in events), events


async def test_a_handed_back_turn_is_asked_again(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conv("a", 2)])
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    src = _source(tmp_path, ds)
    first = await src.next()
    assert first is not None and first.id == "a#t1"
    src.booked(first, Booked(BookedAs.HANDED_BACK))
    again = await src.next()
    assert again is first


async def test_a_run_resumes_each_conversation_at_its_next_turn_with_the_stored_answers(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conv(f"c{i}", 3) for i in range(4)])
    responses = tmp_path / "responses.jsonl"
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    first = await _drive(_source(tmp_path, ds), ds, _own, responses, stop_after=6)  # a crash after 6 turns
    # The next run: the record book counts what is on disk, the source goes on from there.
    ds2 = _dataset(tmp_path, path)
    stored = [orjson.loads(line) for line in responses.read_bytes().splitlines()]
    for rec in stored:
        ds2.answered(rec["id"], 5, 0.0, short=False, now=False)
    _count(ds2, path)
    second = await _drive(_source(tmp_path, ds2), ds2, _own, responses)
    done_first = {p.id for p in first}
    assert not done_first & {p.id for p in second}  # no turn asked twice
    assert done_first | {p.id for p in second} == {f"c{i}#t{k}" for i in range(4) for k in (1, 2, 3)}  # none lost
    for p in second:  # the resumed turns carry the stored answers, as sent the first time
        for j, m in enumerate((m for m in p.messages if m["role"] == "assistant"), start=1):
            assert m["content"] == f"OWN answer to {p.turn.conversation}#t{j}"
            assert m["reasoning_details"][0]["text"] == f"thinking about OWN answer to {p.turn.conversation}#t{j}"
    assert ds2.done == ds2.total == 12 and ds2.conversations.done == 4


async def test_a_stored_failure_ends_its_conversation_until_retry_failed_removes_it(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conv("a", 3)])
    responses, failures = tmp_path / "responses.jsonl", tmp_path / "failures.jsonl"
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    asked = await _drive(_source(tmp_path, ds), ds, lambda p: Booked(BookedAs.FAILED, reason="400")
                         if p.id == "a#t2" else _own(p), responses)
    assert [p.id for p in asked] == ["a#t1", "a#t2"]
    t2 = asked[1]
    failures.write_bytes(orjson.dumps(FailureRecord(id=t2.id, messages=t2.messages, error_kind="400", status=400,
                                                    message="bad", attempts=1, ts=1.0, turn=t2.turn).to_dict()) + b"\n")
    ds2 = _dataset(tmp_path, path)
    ds2.answered("a#t1", 5, 0.0, short=False, now=False)
    ds2.failed_one("a#t2", now=False)
    _count(ds2, path)
    assert await _drive(_source(tmp_path, ds2), ds2, _own) == []
    assert ds2.skipped == 1 and ds2.left == 0 and ds2.conversations.ended == 1
    failures.write_bytes(b"")  # what retry-failed does to the failed turn's line
    ds3 = _dataset(tmp_path, path)
    ds3.answered("a#t1", 5, 0.0, short=False, now=False)
    _count(ds3, path)
    again = await _drive(_source(tmp_path, ds3), ds3, _own)
    assert [p.id for p in again] == ["a#t2", "a#t3"]
    assert again[0].messages == t2.messages  # the same request as the failed one


async def test_an_edited_prompt_file_is_said_once_and_its_conversations_are_not_continued(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conv(f"c{i}", 3) for i in range(3)])
    responses = tmp_path / "responses.jsonl"
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    await _drive(_source(tmp_path, ds), ds, _own, responses, stop_after=3)  # turn 1 of each
    edited = [_conv(f"c{i}", 3) for i in range(3)]
    for line in edited[:2]:  # the first user turn of c0 and c1 changed
        line["conversations"][0]["value"] = "changed"
    _write(path, edited)
    ds2 = _dataset(tmp_path, path)
    for i in range(3):
        ds2.answered(f"c{i}#t1", 5, 0.0, short=False, now=False)
    _count(ds2, path)
    events: list[str] = []
    asked = await _drive(_source(tmp_path, ds2, events=events), ds2, _own)
    assert {p.id for p in asked} == {"c2#t2", "c2#t3"}  # only the unchanged conversation goes on
    said = [e for e in events if "edited" in e]
    assert len(said) == 1 and f"{path} line 1: turn 1 of conversation 'c0'" in said[0], events
    assert ds2.skipped == 4 and ds2.left == 0 and ds2.conversations.ended == 2


def test_a_conversation_is_cut_before_its_first_tool_turn_and_capped_by_max_turns(tmp_path):
    conv = parse_conversation(_conv("a", 4, system="sys", tool_after=2))
    assert [m["content"] for m in conv.user_turns] == ["a user turn 1", "a user turn 2"]
    assert conv.system == [{"role": "system", "content": "sys"}] and "tool turn" in conv.cut
    capped = parse_conversation(_conv("a", 4), max_turns=3)
    assert capped.turns == 3 and len(capped.fingerprint) == 3
    # The fingerprint of turn k covers the turns up to k only: a later turn's edit leaves it.
    other = _conv("a", 4)
    other["conversations"][4]["value"] = "changed turn 3"
    assert parse_conversation(other).fingerprint[:2] == parse_conversation(_conv("a", 4)).fingerprint[:2]
    assert parse_conversation(other).fingerprint[2] != parse_conversation(_conv("a", 4)).fingerprint[2]
    path = _write(tmp_path / "p.jsonl", [{"id": "t", "messages": [{"role": "tool", "content": "x"},
                                                                  {"role": "user", "content": "q"}]},
                                         _conv("ok", 1)])
    items = list(read_conversations(path))
    assert isinstance(items[0], Rejection) and "tool turn" in items[0].reason
    assert isinstance(items[1], Conversation)
    first = [p for p in read_prompts(_write(tmp_path / "f.jsonl", [_conv("a", 3)]), "first") if isinstance(p, Prompt)]
    assert [m["content"] for m in first[0].messages] == ["a user turn 1"]


def test_records_carry_the_turn_fields_and_read_them_back():
    turn = TurnFields("c", 2, 3, "0123456789abcdef")
    rec = ResponseRecord(id="c#t2", messages=[], reasoning=None, content="x", tool_calls=None, finish_reason="stop",
                         native_finish_reason=None, provider=None, model=None, generation_id=None, usage=Usage(),
                         latency_s=0.0, attempts=1, truncated=False, empty_content=False, ts=0.0, turn=turn,
                         reasoning_details=[{"type": "reasoning.text", "text": "t"}])
    line = rec.to_dict()
    assert (line["conversation"], line["turn"], line["turns"], line["prompt_hash"]) == ("c", 2, 3, "0123456789abcdef")
    back = ResponseRecord.from_dict(line)
    assert back.turn == turn and back.reasoning_details == [{"type": "reasoning.text", "text": "t"}]
    single = ResponseRecord.from_dict({**line, "conversation": None})
    assert single.turn is None and "conversation" not in single.to_dict()


def test_a_turns_reservation_bound_counts_its_whole_history_reasoning_included():
    from draftgen.core.generate.api.prices import prompt_token_bound
    long = "r" * 5000
    for msg in (history_message("a", long, [{"type": "reasoning.text", "text": long}], server=OPENROUTER),
                history_message("a", long, None, server=OPENROUTER),
                history_message("a", long, None, server=SELF_HOSTED)):
        bare = prompt_token_bound([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
        assert prompt_token_bound([{"role": "user", "content": "q"}, msg]) >= bare + 5000


def test_the_projection_prices_the_turns_left_by_their_longer_histories(tmp_path):
    from draftgen.core.generate.money.forecast import DatasetFigures, forecast
    path = _write(tmp_path / "chat.jsonl", [_conv(f"c{i}", 3) for i in range(10)])
    ds = _dataset(tmp_path, path)
    for i in range(10):  # every turn 1 answered: the turns left are turns 2 and 3, with longer histories
        ds.answered(f"c{i}#t1", 100, 0.001, short=False, now=False)
    _count(ds, path)
    ds.conversations.turn_sum = 10 * (1 + 2 + 3)
    assert ds.conversations.growth(ds.left, ds.done) == pytest.approx(2.5)  # mean turn left 2.5, answered 1
    assert ds.conversations.history_answers(ds.left) == pytest.approx(1.5)  # turns 2 and 3 carry 1 and 2 answers

    def plan(growth: float) -> float:
        figures = DatasetFigures(name="chat", remaining=ds.left, max_tokens=4096, concurrency=8,
                                 token_budget_left=None, answers=10, completion_tokens=1000, cost_usd=0.01,
                                 growth=growth)
        return forecast([figures], spent_usd=0.01, max_usd=None).left_usd
    assert plan(2.5) == pytest.approx(2.5 * plan(1.0))


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_keeps_reasoning_details_whole_streamed_or_not(stream):
    from draftgen.core.generate.api.client import ChatClient
    from draftgen.simulator import SimConfig, SimServer
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, mean_completion_tokens=80, stream_chunk_tokens=3),
                         port=0) as sim, ChatClient(sim.base_url, "sk-test", concurrency=1) as client:
        body = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Explain tides."}],
                "max_tokens": 2048, "include_reasoning": True, **({"stream": True} if stream else {})}
        a = await client.chat(body, details=True)
        plain = await client.chat(body)  # a single-turn request: a stream's details are not joined
    assert a.reasoning and a.reasoning_details == [{"type": "reasoning.text", "text": a.reasoning,
                                                    "format": "unknown", "index": 0}]
    assert plain.reasoning == a.reasoning and (plain.reasoning_details is None) == stream


def test_an_answer_a_filter_or_an_error_ended_is_never_the_history_of_a_later_turn() -> None:
    from draftgen.core.generate.loop.conversations import broken_answer
    assert broken_answer("a partial answer", "content_filter", None) == "ended by content_filter"
    assert broken_answer("a partial answer", "error", None) == "ended by error"
    assert broken_answer("a whole answer", "stop", None) == ""


def test_the_free_checks_and_the_smoke_estimate_read_a_conversation_file_as_the_run_does(tmp_path: Path) -> None:
    """`messages` lines that end with the dataset's own answer (the usual shape of a recorded chat): the
    run drops that answer; the free checks and the smoke test's count of requests read them the same."""
    from types import SimpleNamespace

    from draftgen.core.generate.commands.precheck import count_prompts
    from draftgen.core.generate.commands.smoke_local import count_turns
    path = tmp_path / "chat.jsonl"
    lines = [{"id": f"c{i}", "messages": [m for k in range(3) for m in (
        {"role": "user", "content": f"question {k + 1} of {i}"}, {"role": "assistant", "content": "theirs"})]}
             for i in range(4)]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    ds = SimpleNamespace(name="chat", prompts=path, turns="all", max_turns=None)
    assert count_prompts(SimpleNamespace(datasets=[ds])) == {"chat": 12}  # type: ignore[arg-type]
    assert count_turns(ds)[0] == 12  # type: ignore[arg-type]
    capped = SimpleNamespace(name="chat", prompts=path, turns="all", max_turns=2)
    assert count_prompts(SimpleNamespace(datasets=[capped])) == {"chat": 8}  # type: ignore[arg-type]
    assert count_turns(capped)[0] == 8  # type: ignore[arg-type]


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _agent(cid: str, second_path: str = "a.txt") -> dict[str, Any]:
    """An agent line (OpenAI layout): search, then read `second_path`, then an answer; the dataset's own ids."""
    return {"id": cid, "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": f"{cid}: find the file"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "file"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"{cid}: SEARCH RESULT"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": {"path": second_path}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": f"{cid}: READ RESULT"},
        {"role": "assistant", "content": "DATASET final answer"}]}


def _target_step(p: Prompt) -> Booked:
    """The target's own move at each step: search, read a.txt (arguments in another key order and spacing
    than the dataset's), then an answer; its calls carry Kimi's own ids."""
    k = p.turn.turn if p.turn is not None else 1
    calls = {1: [{"id": "functions.search:0", "type": "function",
                  "function": {"name": "search", "arguments": '{ "q":"file" }'}}],
             2: [{"id": "functions.read:1", "type": "function",
                  "function": {"name": "read", "arguments": '{"path":"a.txt"}'}}]}.get(k)
    return Booked(BookedAs.ANSWERED, _answer("" if calls else f"OWN answer to {p.id}", finish="tool_calls"
                                             if calls else "stop", tool_calls=calls))


async def test_an_agent_line_asks_each_step_with_its_own_calls_and_the_datasets_results(tmp_path):
    path = _write(tmp_path / "agent.jsonl", [_agent("a0"), _agent("a1", second_path="b.txt"), _agent("a2")])
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    responses = tmp_path / "responses.jsonl"
    asked = await _drive(_source(tmp_path, ds), ds, _target_step, responses, stop_after=4, concurrency=3)
    # killed after 4 bookings: the next source resumes each conversation at its next step, none asked twice
    src = _source(tmp_path, ds)
    asked += await _drive(src, ds, _target_step, responses)
    assert sorted(p.id for p in asked) == ["a0#t1", "a0#t2", "a0#t3", "a1#t1", "a1#t2", "a2#t1", "a2#t2", "a2#t3"]
    third = next(p for p in asked if p.id == "a0#t3")
    assert third.turn is not None and third.turn.tools == TOOLS and third.turn.tool_results == "matched"
    assert [(m["role"], m.get("tool_call_id"), m["content"]) for m in third.messages] == [
        ("system", None, "You are an agent."), ("user", None, "a0: find the file"),
        ("assistant", None, ""), ("tool", "functions.search:0", "a0: SEARCH RESULT"),
        ("assistant", None, ""), ("tool", "functions.read:1", "a0: READ RESULT")]
    sent_calls = [m["tool_calls"] for m in third.messages if m["role"] == "assistant"]
    assert sent_calls == [[{"id": "functions.search:0", "type": "function",
                            "function": {"name": "search", "arguments": '{ "q":"file" }'}}],
                          [{"id": "functions.read:1", "type": "function",
                            "function": {"name": "read", "arguments": '{"path":"a.txt"}'}}]]
    assert all(m["reasoning_details"] for m in third.messages if m["role"] == "assistant")  # passed back
    lines = [orjson.loads(x) for x in responses.read_bytes().splitlines()]
    assert [r["id"] for r in lines if r.get("diverged")] == ["a1#t2"]  # read b.txt recorded, a.txt called
    assert all(r["tools"] == TOOLS for r in lines)
    assert ds.conversations.diverged == 1 and ds.conversations.by_turn_diverged == {2: 1}
    assert (ds.conversations.done, ds.conversations.ended, ds.skipped) == (2, 1, 1)
    assert ds.conversations.reasons == {"diverged": 1}


async def test_replay_splices_the_recorded_result_after_other_calls_and_flags_the_step(tmp_path):
    path = _write(tmp_path / "agent.jsonl", [_agent("a1", second_path="b.txt")])
    ds = _dataset(tmp_path, path)
    ds.config = DatasetConfig(name="chat", prompts=path, turns="all", tool_results="replay")
    _count(ds, path)
    asked = await _drive(_source(tmp_path, ds), ds, _target_step, tmp_path / "responses.jsonl")
    assert [p.id for p in asked] == ["a1#t1", "a1#t2", "a1#t3"]
    assert [p.turn.tool_results for p in asked if p.turn is not None] == [None, "matched", "replayed"]
    assert asked[2].messages[-1] == {"role": "tool", "tool_call_id": "functions.read:1", "content": "a1: READ RESULT"}
    assert ds.conversations.done == 1 and not ds.conversations.diverged


def test_an_agent_line_is_read_as_steps_and_its_fingerprint_covers_tools_and_results():
    conv = parse_conversation(_agent("a"))
    assert conv.turns == 3 and conv.tools == TOOLS and conv.steps is not None
    assert [s.calls for s in conv.steps] == [[("search", {"q": "file"})], [("read", {"path": "a.txt"})], []]
    assert [s.results for s in conv.steps] == [[], ["a: SEARCH RESULT"], ["a: READ RESULT"]]
    edited = _agent("a")
    edited["messages"][5]["content"] = "another result"
    assert parse_conversation(edited).fingerprint[:2] == conv.fingerprint[:2]
    assert parse_conversation(edited).fingerprint[2] != conv.fingerprint[2]
    other_tools = {**_agent("a"), "tools": TOOLS[:1]}
    assert parse_conversation(other_tools).fingerprint[0] != conv.fingerprint[0]
    no_result = _agent("a")
    del no_result["messages"][5]  # read's result missing: cut before the step that would send the call bare
    cut = parse_conversation(no_result)
    assert cut.turns == 2 and "no result" in cut.cut


def test_an_agent_line_whose_tools_are_nested_too_deep_to_write_is_refused_with_a_message():
    """orjson reads 1,024 levels and writes 254: such `tools` could not be fingerprinted nor sent (an error
    of the engine's own that stopped the run as the line was read)."""
    deep = {**_agent("a"), "tools": [{"type": "function", "function": {
        "name": "search", "parameters": orjson.loads("[" * 300 + "]" * 300)}}]}
    with pytest.raises(ValueError, match="`tools` is nested deeper than 254 levels"):
        parse_conversation(deep)


async def test_an_agent_line_edited_between_runs_is_said_and_not_continued(tmp_path):
    path = _write(tmp_path / "agent.jsonl", [_agent("a0"), _agent("a1")])
    ds = _dataset(tmp_path, path)
    _count(ds, path)
    responses = tmp_path / "responses.jsonl"
    asked = await _drive(_source(tmp_path, ds), ds, _target_step, responses, stop_after=4, concurrency=2)
    assert sorted(p.id for p in asked) == ["a0#t1", "a0#t2", "a1#t1", "a1#t2"]
    edited = [_agent("a0"), _agent("a1")]
    edited[0]["messages"][3]["content"] = "a0: ANOTHER SEARCH RESULT"  # the result step 2 was sent with
    _write(path, edited)
    ds2 = _dataset(tmp_path, path)
    for p in asked:
        ds2.answered(p.id, 5, 0.0, short=False, now=False)
    _count(ds2, path)
    events: list[str] = []
    again = await _drive(_source(tmp_path, ds2, events=events), ds2, _target_step, responses)
    assert [p.id for p in again] == ["a1#t3"]  # the unchanged line goes on; the edited one is not mixed
    said = [e for e in events if "edited" in e]
    assert len(said) == 1 and f"{path} line 1: turn 2 of conversation 'a0'" in said[0], events
