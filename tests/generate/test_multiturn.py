"""turns = "all" datasets against the simulator on 127.0.0.1 (real client, real Kimi tokenizer in the
simulator's counts): every user turn asked once, in order, each request's history made only of the
target's own earlier answers (the simulator's request log says what it was sent and what it answered);
kill -9 mid-conversation resumes at the next turn, nothing paid twice or lost; a broken turn ends its
conversation; a prompt file edited between runs is said and never mixed. What each request carried is
the simulator's log of the requests it received (`SimServer.sent`)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.reconcile import reconcile
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.stats import prompt_key
from tests.helpers import TEST_KEY, cli_env, make_config, until


def conversation(cid: str, n: int, *, poison_at: int | None = None) -> dict[str, Any]:
    """A ShareGPT line: n user turns, each followed by the dataset's own (never sent) answer."""
    turns: list[dict[str, str]] = [{"from": "system", "value": "You are a careful assistant."}]
    for k in range(1, n + 1):
        ask = f"{cid}: question {k} on topic {cid}" + (" POISON" if poison_at == k else "")
        turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": f"DATASET answer {k} of {cid}"}]
    return {"id": cid, "conversations": turns}


def write_conversations(path: Path, lines: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return str(path.relative_to(path.parent.parent))


def records(path: Path) -> list[dict[str, Any]]:
    """The file's complete lines: a line still being written by a running (or killed) engine is not one."""
    if not path.exists():
        return []
    return [orjson.loads(x) for x in path.read_bytes().split(b"\n")[:-1] if x]


def assert_own_histories(sent: Any, answered: list[dict[str, Any]]) -> int:
    """Every assistant message a request carried is the target's stored answer to the request made of
    the messages before it (that earlier turn as it was sent), its reasoning_details passed back
    unmodified; returns how many requests carried a history."""
    answers = {prompt_key(r["messages"]): r for r in answered}
    with_history = 0
    for e in sent:
        msgs = e.messages
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            earlier = answers.get(prompt_key(msgs[:i]))
            assert earlier is not None, f"a history answer the target never gave: {m['content'][:80]!r}"
            assert m == {"role": "assistant", "content": earlier["content"],
                         "reasoning_details": earlier["reasoning_details"]}
            assert "DATASET" not in m["content"] and m["reasoning_details"]
        with_history += any(m["role"] == "assistant" for m in msgs)
    return with_history


async def start_run(cfg: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
        "--interval", "0.5", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True)


async def kill_loop(tmp_path: Path, name: str, prompts: str, thresholds: tuple[int, ...], total: int
                    ) -> tuple[Any, tuple[Any, ...]]:
    """Headless runs of a turns = "all" dataset `name` (concurrency 10, streamed, against a simulator with
    latency) killed with SIGKILL once it has each of `thresholds` records, then one run to its end (exit 0)
    and reconcile. Asserts that no turn stored before a kill is asked after it, and that the ledger is the
    bill (what it could not price within its worst case). Returns the config and the simulator's log of the
    requests it received."""
    async with SimServer(SimConfig(seed=8, latency_scale=0.15, mean_completion_tokens=120, sent_log_size=10_000),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": name, "prompts": prompts, "turns": "all",
                                                    "concurrency": 10, "max_tokens": 2048}],
                          tables={"api": {"stream": True}, "engine": {"reconstruct": False}})
        rd = RunDir(cfg.run_dir)
        kills: list[tuple[int, set[str]]] = []  # (requests the simulator had received, turns stored) at each kill
        for threshold in thresholds:
            proc = await start_run(cfg)
            while len(records(rd.responses(name))) < threshold and proc.returncode is None:
                await asyncio.sleep(0.02)
            assert proc.returncode is None, "the run ended before the kill"
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            stored = records(rd.responses(name))
            kills.append((sim.stats.requests_total, {prompt_key(r["messages"]) for r in stored}))
            assert 0 < len(stored) < total
        _, report, billed, log = await run_to_end(cfg, sim)
    for seq, stored_keys in kills:  # a turn stored before a kill is never asked again after it
        again = [e for e in log if e.seq > seq and prompt_key(e.messages) in stored_keys]
        assert not again, f"{len(again)} stored turn(s) asked again after a kill"
    r = report.reconciliation
    print(f"kills at {[len(stored) for _, stored in kills]} turns stored; {len(log)} requests; "
          f"billed ${billed:.4f}, ledger ${r.total_usd:.4f}, unknown {r.unknown} (<= ${r.unknown_worst_usd:.4f})")
    assert r.pending == 0 and r.total_usd <= billed + 1e-4 <= r.total_usd + r.unknown_worst_usd + 2e-4  # ledger = bill
    return cfg, log


async def run_to_end(cfg: Any, sim: SimServer) -> tuple[str, Any, float, tuple[Any, ...]]:
    """A headless run of `cfg` to its end (exit 0), then reconcile: (its output, the reconcile report, what
    the simulator billed once every generation was billed, its log of the requests it received)."""
    proc = await start_run(cfg)
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    report = await reconcile(cfg, TEST_KEY, lookup_s=5)
    await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0, "the billing to end")
    return text, report, sim.stats.billed_usd, sim.sent


async def test_thirty_conversations_run_headless_each_turn_once_on_the_targets_own_answers(tmp_path):
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", [conversation(f"c{i}", 3) for i in range(30)])
    async with SimServer(SimConfig(seed=4, latency_scale=0.02, mean_completion_tokens=60, sent_log_size=10_000),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                    "concurrency": 8, "max_tokens": 2048}],
                          tables={"api": {"stream": True}, "engine": {"reconstruct": False}})
        text, report, billed, log = await run_to_end(cfg, sim)
    rd = RunDir(cfg.run_dir)
    lines = records(rd.responses("chat"))
    expected = {f"c{i}#t{k}" for i in range(30) for k in (1, 2, 3)}
    assert sorted(r["id"] for r in lines) == sorted(expected)  # each turn answered once
    assert len(log) == 90 and set(Counter(prompt_key(e.messages) for e in log).values()) == {1}  # asked once
    assert assert_own_histories(log, lines) == 60
    for r in lines:  # the record is what was sent, and says which turn it is
        assert (r["conversation"], r["turn"], r["turns"]) == (r["id"].split("#t")[0], int(r["id"].split("#t")[1]), 3)
        assert sum(m["role"] == "user" for m in r["messages"]) == r["turn"]
        assert r["reasoning_details"] and "".join(d["text"] for d in r["reasoning_details"]) == r["reasoning"]
    assert report.reconciliation.total_usd == pytest.approx(billed, abs=1e-6)  # ledger = bill
    assert "90/90" in text or "90 of 90" in text, text[-2000:]


@pytest.mark.slow
async def test_kill_9_mid_conversation_resumes_at_the_next_turn_nothing_paid_twice_or_lost(tmp_path):
    n_conv, n_turns = 30, 4
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl",
                                  [conversation(f"c{i}", n_turns) for i in range(n_conv)])
    cfg, log = await kill_loop(tmp_path, "chat", prompts, (12, 40, 75), n_conv * n_turns)
    lines = records(RunDir(cfg.run_dir).responses("chat"))
    ids = [r["id"] for r in lines]
    assert len(ids) == len(set(ids)) == n_conv * n_turns  # none twice, none lost
    assert assert_own_histories(log, lines) >= n_conv * (n_turns - 1)
    for r in lines:  # the stored record's history is the stored answers of its conversation
        earlier = {x["turn"]: x for x in lines if x["conversation"] == r["conversation"] and x["turn"] < r["turn"]}
        sent = [m for m in r["messages"] if m["role"] == "assistant"]
        assert [m["content"] for m in sent] == [earlier[k]["content"] for k in sorted(earlier)]


async def run_engine(cfg: Any) -> tuple[Engine, Any, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    engine = Engine(cfg, TEST_KEY, on_event=lambda p: events.append((str(p.kind), p.text())), seed=1)
    state = await engine.run()
    return engine, state, events


async def test_a_turn_that_fails_for_good_ends_its_conversation_and_nothing_is_asked_after_it(tmp_path):
    lines = [conversation(f"c{i}", 3, poison_at=2 if i == 3 else None) for i in range(6)]
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", lines)
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40, sent_log_size=10_000,
                                   scenarios={"invalid_prompt": {"match": "POISON"}}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                    "concurrency": 4}])
        engine, _state, events = await run_engine(cfg)
        log = sim.sent
    rd = RunDir(cfg.run_dir)
    assert [r["id"] for r in records(rd.failures("chat"))] == ["c3#t2"]
    assert records(rd.failures("chat"))[0]["turn"] == 2
    assert not any(e.messages[-1]["content"].startswith("c3: question 3") for e in log)
    row = next(d for d in engine.snapshot().datasets if d.name == "chat")
    assert (row.done, row.failed, row.skipped, row.total) == (16, 1, 1, 18)
    assert any("conversation 'c3' ended at turn 2 of 3: failed" in msg for _, msg in events), events
    assert_own_histories(log, records(rd.responses("chat")))


async def test_an_edited_prompt_file_is_said_and_its_conversation_is_not_continued(tmp_path):
    path = tmp_path / "prompts" / "chat.jsonl"
    prompts = write_conversations(path, [conversation(f"c{i}", 3) for i in range(5)])
    async with SimServer(SimConfig(seed=6, latency_scale=0.0, mean_completion_tokens=40, sent_log_size=10_000),
                         port=0) as sim:
        first = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                      "max_turns": 2, "concurrency": 4}])
        await run_engine(first)
        assert len(records(RunDir(first.run_dir).responses("chat"))) == 10
        edited = [conversation(f"c{i}", 3) for i in range(5)]
        edited[1]["conversations"][3]["value"] = "c1: a different second question"  # user turn 2 of c1
        write_conversations(path, edited)
        seen = len(sim.sent)
        # max_turns lifted: every conversation has a third turn to ask on its stored answers
        again = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                      "concurrency": 4}])
        engine, _state, events = await run_engine(again)
        log = sim.sent
    asked = [e.messages[-1]["content"] for e in log[seen:]]
    assert sorted(asked) == sorted(f"c{i}: question 3 on topic c{i}" for i in (0, 2, 3, 4))
    said = [msg for kind, msg in events if kind == "conversation"]
    assert len(said) == 1 and f"{path} line 2: turn 2 of conversation 'c1'" in said[0], events
    lines = records(RunDir(again.run_dir).responses("chat"))
    assert {r["id"] for r in lines if r["conversation"] == "c1"} == {"c1#t1", "c1#t2"}  # its stored turns stay
    assert_own_histories(log, lines)
    row = next(d for d in engine.snapshot().datasets if d.name == "chat")
    assert (row.done, row.skipped, row.total) == (14, 1, 15)


async def test_the_views_count_turns_and_show_conversations_turn_by_turn(tmp_path):
    from rich.console import Console

    from draftgen.core.live.summary import summary_lines
    from draftgen.headless.printer import detail_lines
    from draftgen.tui.screens.drill import DATASET, Target, draw_drill

    lines = [conversation(f"c{i}", 3, poison_at=2 if i == 3 else None) for i in range(6)]
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", lines)
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40,
                                   scenarios={"invalid_prompt": {"match": "POISON"}}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                    "concurrency": 1}])
        engine, _state, events = await run_engine(cfg)
    s = engine.snapshot()
    row = next(d for d in s.datasets if d.name == "chat")
    assert (row.conversations, row.conversations_done, row.conversations_ended) == (6, 5, 1)
    assert row.turns_by_number == ((6, 6), (5, 6), (5, 6))
    assert row.last_conversation[0].startswith("c5 (3 turns, line 6): done") and len(row.last_conversation) == 4
    assert any("18 turns of 6 conversations" in msg for _, msg in events)
    assert any("conversations: 5/6 done, 1 ended early: 1 failed" in msg for _, msg in events), events
    assert any("16/18 turns (5/6 conversations done, 1 ended early) answered" in x for x in detail_lines(s))
    summary = "\n".join(summary_lines(s, 0))
    assert "chat: counts are turns; 5/6 conversations done, 1 ended early (answered by turn: t1 6/6, t2 5/6, " \
           "t3 5/6)" in summary, summary
    console = Console(width=120, record=True)
    console.print(draw_drill(s, Target(DATASET, "chat")))
    text = console.export_text()
    assert "answered by turn" in text and "t2 5/6" in text and "turn 3: answered" in text, text


async def test_turns_first_and_last_ask_one_request_per_line(tmp_path):
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", [conversation(f"c{i}", 3) for i in range(3)])
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40, sent_log_size=100),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "first", "prompts": prompts, "turns": "first"},
                                                   {"name": "last", "prompts": prompts}],
                          tables={"engine": {"skip_cross_dataset_duplicates": False}})
        await run_engine(cfg)
        sent = sim.sent
    firsts = [e.messages for e in sent if len(e.messages) == 2]
    lasts = [e.messages for e in sent if len(e.messages) > 2]
    assert len(firsts) == 3 and all(m[-1]["content"].endswith(" question 1 on topic " + m[-1]["content"][:2])
                                    for m in firsts)
    # "last" (the default) keeps today's behaviour: the dataset's turns up to the last user turn
    assert len(lasts) == 3 and all(len(m) == 6 and "DATASET" in m[2]["content"] for m in lasts)


async def test_retry_failed_resumes_a_conversation_at_its_failed_turn_on_the_stored_answers(tmp_path):
    # Headless, as a user runs it: turn 2 of c3 fails for good (the simulator refuses it as the prompt's
    # own fault), `draftgen retry-failed` makes it eligible again, and the next run asks c3 from turn 2
    # on its stored turn-1 answer: the same request as the failed one, nothing answered twice.
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", [conversation(f"c{i}", 3) for i in range(6)])
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=40, sent_log_size=10_000,
                                   scenarios={"invalid_prompt": {"match": "c3: question 2 "}}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                    "concurrency": 4}], tables={"engine": {"reconstruct": False}})
        rd = RunDir(cfg.run_dir)
        first = await start_run(cfg)
        out, _ = await asyncio.wait_for(first.communicate(), 120)
        assert [r["id"] for r in records(rd.failures("chat"))] == ["c3#t2"], out.decode()[-3000:]
        assert "16/18" in out.decode(), out.decode()[-3000:]  # c3's turn 3 never asked: skipped
        failed_request = records(rd.failures("chat"))[0]["messages"]
        before = len(sim.sent)
        sim.scenario("invalid_prompt", on=False)  # the fault is gone
        retry = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "retry-failed", str(cfg.path), env=cli_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        said, _ = await asyncio.wait_for(retry.communicate(), 60)
        assert retry.returncode == 0 and "1 failed prompt(s) eligible again" in said.decode(), said.decode()
        second = await start_run(cfg)
        out, _ = await asyncio.wait_for(second.communicate(), 120)
        assert second.returncode == 0, out.decode()[-3000:]
        await until(lambda: sim.stats.generations_running == 0, "the billing to end")
        log, stats = sim.sent, sim.stats
    again = [e.messages for e in log[before:]]
    assert [m[-1]["content"] for m in again] == ["c3: question 2 on topic c3", "c3: question 3 on topic c3"]
    assert again[0] == failed_request  # the failed turn asked again as it was: on the stored turn-1 answer
    lines = records(rd.responses("chat"))
    assert sorted(r["id"] for r in lines) == sorted(f"c{i}#t{k}" for i in range(6) for k in (1, 2, 3))
    assert not records(rd.failures("chat"))
    assert_own_histories(log, lines)
    # No turn paid twice: one billed generation per answered turn (the refusal cost nothing).
    assert sorted(stats.prompt_answers.values()) == [1] * 18
    assert set(stats.prompt_answers) == {prompt_key(r["messages"]) for r in lines}


@pytest.mark.parametrize("budget", [{"token_budget": 300}, {"max_usd": 0.0075}])
async def test_a_turn_that_would_pass_a_budget_ends_its_conversation_there(tmp_path, budget):
    # One conversation at a time goes further than the others (concurrency 1: c0 and c1 interleave), so the
    # budget is met mid-conversation: that turn is not asked, its conversation ends there (nothing later
    # asked on it), and every turn not asked is counted skipped with the budget as the reason.
    prompts = write_conversations(tmp_path / "prompts" / "chat.jsonl", [conversation(f"c{i}", 3) for i in range(6)])
    token_budget = budget.get("token_budget")
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40, length_sigma=0.0,
                                   sent_log_size=10_000), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "chat", "prompts": prompts, "turns": "all",
                                                    "concurrency": 1, "max_tokens": 200 if token_budget else 2048,
                                                    **({"token_budget": token_budget} if token_budget else {})}],
                          tables={"engine": {"reconstruct": False},
                                  **({} if token_budget else {"budget": {"max_usd": budget["max_usd"]}})})
        engine, _state, events = await run_engine(cfg)
        log = sim.sent
    lines = records(RunDir(cfg.run_dir).responses("chat"))
    answered: dict[str, set[int]] = {}
    for r in lines:
        answered.setdefault(r["conversation"], set()).add(r["turn"])
    asked: dict[str, set[int]] = {}
    for e in log:
        cid, k = e.messages[-1]["content"].split(": question ")
        asked.setdefault(cid, set()).add(int(k.split()[0]))
    assert asked == answered  # every turn asked was answered: none sent past the budget, none failed
    assert all(ks == set(range(1, len(ks) + 1)) for ks in answered.values())  # each conversation: turns 1..j
    assert any(0 < len(ks) < 3 for ks in answered.values()), answered  # one ended mid-conversation
    row = next(d for d in engine.snapshot().datasets if d.name == "chat")
    assert (row.done, row.failed, row.skipped, row.total) == (len(lines), 0, 18 - len(lines), 18)
    assert 0 < len(lines) < 18 and row.conversations_done == sum(len(ks) == 3 for ks in answered.values())
    assert row.conversations_ended == 6 - row.conversations_done
    reason = "the token budget" if token_budget else "max_usd"
    said = [msg for kind, msg in events if "ended at turn" in msg]
    assert said and reason.removeprefix("the ") in said[0], events
    done_line = next(msg for kind, msg in events if "conversations:" in msg and "ended early" in msg)
    assert f"{row.conversations_ended} skipped for {reason}" in done_line, done_line
