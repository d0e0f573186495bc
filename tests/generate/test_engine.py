"""The engine against the simulator's real HTTP server on 127.0.0.1, through the real aiohttp client."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random

import orjson
import pytest

from draftgen.core.generate.api.classify import ANSWER_KINDS
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.service import backoff_delay
from draftgen.core.live import payloads as ev
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Event, EventKind
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, read_ids, until

FAST = dict(latency_scale=0.0, mean_completion_tokens=60)


def lines(path):
    return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


async def run_engine(config, **kw):
    events = []
    engine = Engine(config, TEST_KEY, on_event=lambda p: events.append((p.level, p.kind, p.text())), seed=1, **kw)
    state = await engine.run()
    return engine, state, events


def accounted(config, engine):
    """Every prompt id ends answered, failed or skipped exactly once."""
    rd = RunDir(config.run_dir)
    for ds in config.datasets:
        answered = read_ids(rd.responses(ds.name))
        failed = read_ids(rd.failures(ds.name))
        assert len(answered) == len(set(answered)), "an id answered twice"
        assert not set(answered) & set(failed), "an id both answered and failed"
        run = dataset_row(engine, ds.name)
        assert len(answered) + len(failed) + run.skipped == run.total, (ds.name, len(answered), len(failed),
                                                                          run.skipped, run.total)


async def test_answers_land_with_every_field(tmp_path):
    async with SimServer(SimConfig(seed=3, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 8},
                                                   {"name": "b", "n": 20, "concurrency": 4, "max_tokens": 2048}],
                          request={"temperature": 0.6, "include_reasoning": True,
                                   "provider": {"ignore": ["fireworks", "baseten"], "quantizations": ["int4"]}})
        engine, state, events = await run_engine(cfg)
    assert state == snap.RunState.DONE
    rd = RunDir(cfg.run_dir)
    recs = lines(rd.responses("a"))
    assert len(recs) == 30
    for key in ("id", "messages", "reasoning", "content", "finish_reason", "native_finish_reason", "provider",
                "model", "generation_id", "usage", "latency_s", "attempts"):
        assert key in recs[0], key
    assert set(recs[0]["usage"]) >= {"prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"}
    assert all(r["provider"] not in ("Fireworks", "Baseten") for r in recs)
    assert recs[0]["reasoning"] and recs[0]["usage"]["cost"] > 0
    s = engine.snapshot()
    assert [d.status for d in s.datasets] == ["done", "done"]
    assert s.throughput.req_s_total > 0 and s.credits.spent_usd > 0
    assert sum(n for _, n in s.providers) == 50
    run_json = orjson.loads(rd.run_json.read_bytes())
    assert run_json["fingerprint"] == cfg.run_fingerprint()
    assert TEST_KEY not in rd.run_json.read_text()


async def test_requests_run_in_a_pool_of_coroutines_not_a_task_each(tmp_path):
    """A dataset's requests are asked by as many coroutines as its concurrency, each admitting its own next
    prompt: the run makes a few tasks, not one per prompt, and every prompt is still asked once, in order."""
    loop = asyncio.get_running_loop()
    made = []

    def factory(loop, coro, **kw):  # the engine's own tasks (not aiohttp's, nor the simulator's in this loop)
        frame = getattr(coro, "cr_frame", None)
        if frame is not None and frame.f_globals.get("__name__", "").startswith("draftgen.core."):
            made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kw)

    async with SimServer(SimConfig(seed=3, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 300, "concurrency": 4}])
        previous = loop.get_task_factory()
        loop.set_task_factory(factory)
        try:
            engine, state, _ = await run_engine(cfg)
        finally:
            loop.set_task_factory(previous)
    assert state == snap.RunState.DONE
    accounted(cfg, engine)
    assert made.count("Admission._requests_of") == 4
    assert len(made) < 30, sorted(made)  # 300 prompts: a task each would be 300 more
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == 300


def _hang_fsyncs(monkeypatch):
    """The spend ledger's group fsyncs hang in their thread (the loop goes on) until the returned gate is
    set: every request admitted meanwhile waits with its `sent` line not yet durable, none is sent."""
    import threading

    from draftgen.core import rundir
    gate = threading.Event()
    real = rundir._fsync_and_close

    def slow_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("spend.jsonl"):
            gate.wait(10)
        real(fd)

    monkeypatch.setattr(rundir, "_fsync_and_close", slow_fsync)
    return gate


async def _waiting_for_the_ledger(tmp_path, sim, n: int) -> tuple:
    """A run of `n` prompts at concurrency 4, started and left once its 4 slots are admitted, each waiting for
    its sent line's fsync: nothing has been sent yet. Its config, engine and task."""
    cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 4}])
    engine = Engine(cfg, TEST_KEY, seed=1)
    task = asyncio.create_task(engine.run())
    await until(lambda: engine.in_flight == 4, "4 requests waiting for the fsync")
    assert sim.stats.requests_total == 0
    return cfg, engine, task


async def test_a_request_whose_sent_line_is_still_being_fsynced_when_the_run_pauses_does_not_leave(
        tmp_path, monkeypatch):
    """Admitted, its `sent` line waiting for the group fsync, then the run pauses (the user, or an account's
    402): it is not sent after the pause; the ledger books it refused (nothing billed), its prompt is handed
    back and asked once the run resumes."""
    gate = _hang_fsyncs(monkeypatch)
    async with SimServer(SimConfig(seed=3, **FAST), port=0) as sim:
        cfg, engine, task = await _waiting_for_the_ledger(tmp_path, sim, 20)
        engine.pause()
        gate.set()
        await until(lambda: engine.in_flight == 0, "the waiting requests handed back")
        await asyncio.sleep(0.2)
        assert sim.stats.requests_total == 0, "a request left after the run paused"
        engine.resume()
        assert await asyncio.wait_for(task, 30) == snap.RunState.DONE
    accounted(cfg, engine)
    assert len(read_ids(RunDir(cfg.run_dir).responses("a"))) == 20
    ends = [x for x in lines(RunDir(cfg.run_dir).spend) if x["e"] == "end"]
    assert sum(x["o"] == "refused" and x["c"] == 0 for x in ends) == 4
    assert sum(x["o"] == "answered" for x in ends) == 20


async def test_a_drain_lets_the_requests_it_admitted_go_out_and_finish(tmp_path, monkeypatch):
    """A drain admits nothing more; what it admitted, even still waiting for its `sent` line's fsync, goes
    out and is recorded (unlike a pause, which hands those back)."""
    gate = _hang_fsyncs(monkeypatch)
    async with SimServer(SimConfig(seed=3, **FAST), port=0) as sim:
        cfg, engine, task = await _waiting_for_the_ledger(tmp_path, sim, 40)
        engine.drain()
        gate.set()
        assert await asyncio.wait_for(task, 30) == snap.RunState.DRAINED
    assert dataset_row(engine, "a").done == 4, "what the drain found admitted was not asked"
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == len(set(ids)) == dataset_row(engine, "a").done


async def test_the_elapsed_time_stops_when_the_run_ends(tmp_path):
    """The header's elapsed and the exit summary's "after X" are the run's: they stop when it ends, not
    when the screen is closed (the pipeline's stages may go on for minutes after it)."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.01  # every read moves time on, so a running clock is seen
        return now[0]

    async with SimServer(SimConfig(seed=3, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "concurrency": 2}])
        engine, state, _ = await run_engine(cfg, clock=clock)
    assert state == snap.RunState.DONE
    ended = engine.snapshot().elapsed_s
    now[0] += 600.0
    assert engine.snapshot().elapsed_s == ended > 0


@pytest.mark.parametrize("keep", [100, 5])
async def test_a_small_prompt_file_is_read_once_and_a_big_one_streamed_each_asking_every_prompt_once(
        tmp_path, monkeypatch, keep):
    """A file of at most KEEP_SCANNED_PROMPTS prompts is asked from what its count parsed (not read
    again); a bigger one is streamed in chunks. Either way a second run asks only what is not on disk."""
    from draftgen.core.generate.loop import record_book
    monkeypatch.setattr(record_book, "KEEP_SCANNED_PROMPTS", keep)
    streamed = []
    real = record_book.read_prompts
    monkeypatch.setattr(record_book, "read_prompts", lambda *a: streamed.append(a) or real(*a))
    async with SimServer(SimConfig(seed=5, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 4,
                                                    "max_tokens": 64}])
        _, state, _ = await run_engine(cfg)
        assert state == snap.RunState.DONE
        assert len(streamed) == (0 if keep >= 30 else 1)
        rd = RunDir(cfg.run_dir)
        first = read_ids(rd.responses("a"))
        assert sorted(first) == sorted(f"a-{i}" for i in range(30))
        # Ten more prompts at the end of the file: the next run asks those and nothing else.
        with open(cfg.datasets[0].prompts, "ab") as f:
            f.writelines(orjson.dumps({"id": f"a-{i}", "prompt": f"Question {i}"}) + b"\n" for i in range(30, 40))
        engine, state, _ = await run_engine(cfg)
    assert state == snap.RunState.DONE
    assert read_ids(rd.responses("a")) == first + read_ids(rd.responses("a"))[30:]
    assert sorted(read_ids(rd.responses("a"))[30:]) == sorted(f"a-{i}" for i in range(30, 40))
    assert dataset_row(engine, "a").done == 40


async def test_prompts_kept_from_the_count_are_bounded_over_all_the_datasets_together(tmp_path, monkeypatch):
    """Two small files whose prompts together pass KEEP_SCANNED_PROMPTS: the first counted is kept, the
    second streamed (not both held until their datasets start); both asked whole."""
    from draftgen.core.generate.loop import record_book
    monkeypatch.setattr(record_book, "KEEP_SCANNED_PROMPTS", 40)
    streamed = []
    real = record_book.read_prompts
    monkeypatch.setattr(record_book, "read_prompts", lambda path, *a: streamed.append(path.name) or real(path, *a))
    async with SimServer(SimConfig(seed=5, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 4, "max_tokens": 64},
                                                   {"name": "b", "n": 30, "concurrency": 4, "max_tokens": 64}])
        engine, state, _ = await run_engine(cfg)
    assert state == snap.RunState.DONE
    assert streamed == ["b.jsonl"]
    rd = RunDir(cfg.run_dir)
    for name in ("a", "b"):
        assert sorted(read_ids(rd.responses(name))) == sorted(f"{name}-{i}" for i in range(30))


@pytest.mark.parametrize("fault", ["429", "500", "502", "503", "524", "drop", "truncated", "error200",
                                   "finish_error", "empty_choices"])
async def test_every_prompt_accounted_for_under_faults(tmp_path, fault):
    async with SimServer(SimConfig(seed=5, faults={fault: 0.5}, retry_after_s=0.01, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 16}],
                          tables={"engine": {"max_attempts": 4}})
        engine, state, _ = await run_engine(cfg)
        stats = sim.stats
    assert state == snap.RunState.DONE
    accounted(cfg, engine)
    rd = RunDir(cfg.run_dir)
    answered, failed = lines(rd.responses("a")), lines(rd.failures("a"))
    assert answered, "some prompts must get through at a 50% fault rate"
    assert engine.retries > 0
    for f in failed:  # only an answer fault, after max_attempts spent while others were answered
        assert f["attempts"] >= 4 and f["error_kind"] in ANSWER_KINDS and f["message"]
    if fault in ("429", "500", "502", "503", "524", "drop"):
        assert failed == [], "an outage kind never fails a prompt, however often it comes"
    assert sum(stats.faults.values()) > 0


async def test_hung_request_is_cut_by_its_timeout(tmp_path):
    async with SimServer(SimConfig(seed=2, faults={"hang": 0.3}, hang_s=30, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 12}],
                          tables={"api": {"request_timeout_s": 0.5}, "engine": {"max_attempts": 6}})
        engine, state, _ = await run_engine(cfg)
    accounted(cfg, engine)
    assert dict(engine.errors.items()).get("timeout", 0) > 0


async def test_a_refused_key_drains_the_run_and_fails_nothing(tmp_path):
    async with SimServer(SimConfig(seed=1, api_key="the-right-key", **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 50, "concurrency": 5}])
        engine, state, events = await run_engine(cfg)  # TEST_KEY is the wrong key: 401
        requests = sim.stats.requests_total
    assert lines(RunDir(cfg.run_dir).failures("a")) == []  # the key's problem, not the prompts'
    assert state == snap.RunState.DRAINED and engine.key_refused is not None
    assert requests == 5  # the ones in flight when it began; no retry, nothing more admitted
    assert "401" in engine.alert and "key" in engine.alert and TEST_KEY not in engine.alert
    assert any(kind == "account" and "refused" in msg for _, kind, msg in events)


async def test_no_endpoints_stops_the_dataset_without_failing_prompts(tmp_path):
    async with SimServer(SimConfig(seed=1, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 4},
                                                   {"name": "b", "n": 5, "concurrency": 2}],
                          request={"provider": {"only": ["nobody"]}})
        engine, state, events = await run_engine(cfg)
    s = engine.snapshot()
    assert s.datasets[0].status == "stopped" and "no endpoints" in s.datasets[0].message.lower()
    assert not RunDir(cfg.run_dir).failures("a").exists() or not lines(RunDir(cfg.run_dir).failures("a"))
    assert any(kind == "dataset_stopped" for _, kind, _ in events)


async def test_token_budget_stops_admission_and_counts_skipped(tmp_path):
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=400, length_sigma=0.2),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 10, "max_tokens": 1000,
                                                    "token_budget": 20_000}])
        engine, state, events = await run_engine(cfg)
    run = dataset_row(engine, "a")
    assert run.skipped > 0 and run.done > 0
    assert run.done + run.failed + run.skipped == 200
    # Admission counts in-flight expectations: the overshoot is bounded by the requests in flight.
    assert run.tokens_used <= 20_000 + 10 * 1000
    assert engine.snapshot().datasets[0].status == "budget"
    assert any(kind == "budget" for _, kind, _ in events)
    accounted(cfg, engine)


async def test_max_usd_stops_the_run(tmp_path):
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=400), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 300, "concurrency": 8},
                                                   {"name": "b", "n": 50, "concurrency": 8}],
                          tables={"budget": {"max_usd": 0.05}})
        engine, state, _ = await run_engine(cfg)
        billed = sim.stats.billed_usd
    # A hard ceiling: the worst case of every request is reserved before it leaves.
    assert billed <= 0.05 and engine.money.spent_total == pytest.approx(billed, abs=1e-6)
    assert dataset_row(engine, "a").skipped > 0 and dataset_row(engine, "b").skipped == 50
    accounted(cfg, engine)


async def test_credit_floor_holds_the_run_until_a_top_up(tmp_path):
    """The balance reaching credit_floor_usd is the account's condition, not a budget: the run holds
    (nothing skipped, nothing failed) and resumes by itself once a re-read shows credit again."""
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=400, credits=1.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 100, "concurrency": 4}],
                          tables={"budget": {"credit_floor_usd": 0.97}, "api": {"credits_interval_s": 0.1}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        for _ in range(1000):
            await asyncio.sleep(0.02)
            if engine.account is not None:
                break
        assert engine.state == snap.RunState.PAUSED and "credit_floor_usd" in engine.alert
        s = engine.snapshot()
        assert s.credits.balance_usd is not None and s.credits.balance_age_s is not None
        assert dataset_row(engine, "a").skipped == 0 and s.waiting
        sim.update(credits=100.0)  # a top-up
        assert await asyncio.wait_for(task, 60) == snap.RunState.DONE
    assert len(set(read_ids(RunDir(cfg.run_dir).responses("a")))) == 100


async def test_a_retry_meeting_the_credit_floor_is_held_not_failed(tmp_path):
    """A prompt retrying a 502 when the balance falls to credit_floor_usd: its next attempt waits for
    the balance (the run holds), it is neither failed nor skipped, and a top-up lets it finish."""
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=100, faults={"502": 1.0},
                                   credits=10.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "concurrency": 1}],
                          tables={"budget": {"credit_floor_usd": 5.0}, "api": {"credits_interval_s": 0.05},
                                  "engine": {"max_attempts": 1000, "backoff_base_s": 0.01, "backoff_max_s": 0.05}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        while engine.retries < 3:  # the first prompt is retrying its 502s
            await asyncio.sleep(0.01)
        sim.update(credits=1.0)             # the balance drops below the floor meanwhile
        for _ in range(500):
            await asyncio.sleep(0.02)
            if engine.state == snap.RunState.PAUSED:
                break
        assert engine.state == snap.RunState.PAUSED and "credit_floor_usd" in engine.alert
        held_at = sim.stats.requests_total
        await asyncio.sleep(0.3)
        assert sim.stats.requests_total == held_at, "the retry went out below the floor"
        assert engine.in_flight == 1 and dataset_row(engine, "a").failed == 0 and dataset_row(engine, "a").skipped == 0
        sim.update(credits=100.0, faults={})  # a top-up; the provider answers again
        assert await asyncio.wait_for(task, 30) == snap.RunState.DONE
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == len(set(ids)) == 3
    assert not RunDir(cfg.run_dir).failures("a").exists() or not RunDir(cfg.run_dir).failures("a").read_bytes()


async def test_402_pauses_the_run_and_resume_finishes_it(tmp_path):
    # An ordinary key with no cap: the balance is unknown, so no credit-floor hold comes first and
    # the service's own 402 is what pauses the run.
    async with SimServer(SimConfig(seed=4, latency_scale=0.0, mean_completion_tokens=200, credits=0.01,
                                   credits_forbidden=True), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 4}])
        events = []
        engine = Engine(cfg, TEST_KEY, on_event=lambda p: events.append((p.level, p.kind, p.text())), seed=1)
        task = asyncio.create_task(engine.run())
        for _ in range(200):
            await asyncio.sleep(0.05)
            if engine.state == snap.RunState.PAUSED:
                break
        assert engine.state == snap.RunState.PAUSED and "402" in engine.alert
        sim.update(credits=100.0)
        engine.resume()
        state = await asyncio.wait_for(task, 30)
    assert state == snap.RunState.DONE
    assert len(read_ids(RunDir(cfg.run_dir).responses("a"))) == 60
    accounted(cfg, engine)


async def test_pause_stops_admission_and_resume_readmits(tmp_path):
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.2, mean_completion_tokens=50), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 80, "concurrency": 10}])
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        while dataset_row(engine, "a").done < 10:
            await asyncio.sleep(0.02)
        engine.pause()
        await until(lambda: engine.in_flight == 0, "the requests in flight to finish and be recorded")
        requests = sim.stats.requests_total
        await asyncio.sleep(0.4)
        assert sim.stats.requests_total == requests, "no request admitted while paused"
        engine.resume()
        assert await asyncio.wait_for(task, 30) == snap.RunState.DONE
    assert len(read_ids(RunDir(cfg.run_dir).responses("a"))) == 80


async def test_drain_and_stop(tmp_path):
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.3, mean_completion_tokens=50), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 100, "concurrency": 10}])
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        while engine.in_flight < 10:
            await asyncio.sleep(0.01)
        engine.drain()
        # DRAINED, not DONE: 90 prompts were never asked.
        assert await asyncio.wait_for(task, 10) == snap.RunState.DRAINED
        assert dataset_row(engine, "a").done == 10  # the ten in flight finished and were recorded
        assert engine.ended.startswith("DRAINED: 10 of 100 answered") and "90 not asked yet" in engine.ended
        # A second run resumes; stop-now abandons what is in flight without recording it.
        engine2 = Engine(cfg, TEST_KEY, seed=2)
        task = asyncio.create_task(engine2.run())
        while engine2.in_flight < 10:
            await asyncio.sleep(0.01)
        engine2.stop()
        assert await asyncio.wait_for(task, 10) == snap.RunState.STOPPED
        engine3 = Engine(cfg, TEST_KEY, seed=3)
        assert await engine3.run() == snap.RunState.DONE
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == len(set(ids)) == 100


async def test_a_drain_keeps_the_projection_of_the_whole_dataset(tmp_path):
    """After a drain, a dataset that the next run resumes is projected whole (the cost so far plus what
    its prompts not asked yet will cost), as before the drain; the run's projected total too. It showed
    the cost so far: the drained dataset counted as finished."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.05, mean_completion_tokens=50, length_sigma=0.0),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 300, "concurrency": 10}])
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        await until(lambda: dataset_row(engine, "a").done >= 60, "60 answers", 60)
        before = engine.snapshot()
        engine.drain()
        assert await asyncio.wait_for(task, 30) == snap.RunState.DRAINED
        after = engine.snapshot()
    row, was = after.datasets[0], before.datasets[0]
    assert row.status == snap.DatasetStatus.STOPPED and row.done < 100
    assert was.projected_cost_usd is not None and row.projected_cost_usd is not None
    assert row.projected_cost_usd > 2 * row.cost_usd  # two thirds are not asked yet
    assert row.projected_cost_usd == pytest.approx(was.projected_cost_usd, rel=0.05)
    assert after.credits.projected_total_usd == pytest.approx(before.credits.projected_total_usd, rel=0.05)


async def test_a_provider_gone_bad_and_back_is_one_event_each_way(tmp_path):
    """Every request answered 500 naming its provider for a while, then none: each provider that failed
    is said gone bad once (with the errors' kind), and back once when it answers again, not once per
    error; a steady run says nothing."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.02, mean_completion_tokens=30, retry_after_s=0.01),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 600, "concurrency": 8}],
                          tables={"engine": {"max_attempts": 200}})
        events: list[tuple[str, str, str]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append(
            (str(p.level), str(p.kind), p.text())))
        task = asyncio.create_task(engine.run())
        await until(lambda: dataset_row(engine, "a").done >= 60, "60 answers", 60)
        quiet = [e for e in events if e[1] == "provider"]
        sim.scenarios.switch("provider_500", True, {"rate": 1.0})
        await until(lambda: any(e[1] == "provider" for e in events), "a provider said gone bad", 60)
        sim.scenarios.switch("provider_500", False)
        assert await asyncio.wait_for(task, 120) == snap.RunState.DONE
    said = [e for e in events if e[1] == "provider"]
    bad = [m for level, _, m in said if "gone bad" in m]
    back = [m for level, _, m in said if " back: " in m]
    assert quiet == [] and bad, said
    assert all("attempts failed" in m and "5xx" in m for m in bad), bad
    names = [m.split(" gone bad")[0] for m in bad]
    assert len(names) == len(set(names)), bad  # once per provider, not once per error
    assert sorted(m.split(" back:")[0] for m in back) == sorted(names), said  # each one back, once
    assert len(said) == 2 * len(names), said


async def test_sse_streaming(tmp_path):
    async with SimServer(SimConfig(seed=8, **FAST), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 10, "concurrency": 5}],
                          tables={"api": {"stream": True}})
        engine, state, _ = await run_engine(cfg)
    recs = lines(RunDir(cfg.run_dir).responses("a"))
    assert len(recs) == 10 and all(r["content"] and r["reasoning"] for r in recs)
    assert all(r["usage"]["completion_tokens"] > 0 for r in recs)


async def test_sustained_429s_back_off_and_recover():
    clock = [0.0]
    said: list[tuple[bool, str]] = []
    aimd = AdaptiveConcurrency(100, clock=lambda: clock[0], on_change=lambda c: said.append((c.starts, c.text())))
    for _ in range(100):
        aimd.on_send()
    aimd.on_429()
    assert aimd.limit == 100  # one 429 is not sustained
    for _ in range(4):
        clock[0] += 0.1
        aimd.on_429()
    assert aimd.limit == 70 and aimd.in_storm  # 5 of 100 sent
    clock[0] += 0.1
    for _ in range(30):
        aimd.on_429()
    assert aimd.limit == 70  # at most one cut every 2 s
    clock[0] += 2
    aimd.on_429()
    assert aimd.limit == 49
    clock[0] += 10
    while aimd.tick():
        clock[0] += 1
    assert aimd.limit == 100 and not aimd.in_storm
    # One line when the storm starts, one when it ends, one when the limit is back: not one per cut.
    assert [starts for starts, _ in said] == [True, False, False], said
    assert "limit cut 100 → 70" in said[0][1]
    assert "36 rate-limited, 2 cut(s), lowest limit 49" in said[1][1] and "back at the configured 100" in said[2][1]


def test_a_limit_change_carries_its_figures_and_says_the_sentence_it_always_said():
    """Each change of the adaptive limit is a `Concurrency` payload with the limit before and after and
    the reason as fields; its message, built from them, is the sentence the limit used to write itself,
    byte for byte (a dataset's, a fleet server's, and with thousands' commas)."""
    clock = [0.0]
    said: list[ev.Concurrency] = []
    aimd = AdaptiveConcurrency(100, clock=lambda: clock[0], on_change=said.append)
    for _ in range(100):
        aimd.on_send()
    for _ in range(5):
        clock[0] += 0.1
        aimd.on_429()
    clock[0] += 0.1
    for _ in range(30):
        aimd.on_429()
    clock[0] += 2
    aimd.on_429()
    clock[0] += 10
    while aimd.tick():
        clock[0] += 1
    assert [(c.reason, c.before, c.after, c.configured) for c in said] == [
        ("storm", 100, 70, 100), ("over", 100, 49, 100), ("back", 99, 100, 100)]
    assert (said[0].rate_limited, said[0].sent, said[1].rate_limited, said[1].cuts) == (5, 100, 36, 2)
    assert [c.starts for c in said] == [True, False, False]
    assert [Event.of(dataclasses.replace(c, dataset="a")).message for c in said] == [
        "a: 429 storm: 5 of the 100 attempts sent in the last 5 s were rate-limited (a storm is 5+ and 5%+); limit "
        "cut 100 → 70 (30% at most every 2 s while it lasts, then +2% of 100 a second)",
        "a: 429 storm over after 2 s: 36 rate-limited, 2 cut(s), lowest limit 49; growing back to 100",
        "a: limit back at the configured 100"]
    assert dataclasses.replace(said[2], server="10.0.0.2:8000").text() == \
        "server 10.0.0.2:8000: limit back at the configured 100"
    said.clear()
    aimd = AdaptiveConcurrency(2000, clock=lambda: clock[0], on_change=said.append)
    for _ in range(3000):
        aimd.on_send()
    for _ in range(150):
        aimd.on_429()
    assert [c.text() for c in said] == [
        "429 storm: 150 of the 3,000 attempts sent in the last 5 s were rate-limited (a storm is 5+ and 5%+); "
        "limit cut 2,000 → 1,400 (30% at most every 2 s while it lasts, then +2% of 2,000 a second)"]


async def run_watching_concurrency(engine: Engine, start: int) -> tuple[int, snap.RunState]:
    """Run `engine` to its end, reading its first dataset's effective concurrency every 50 ms; the lowest
    seen (at most `start`) and how the run ended."""
    task = asyncio.create_task(engine.run())
    lowest = start
    while not task.done():
        await asyncio.sleep(0.05)
        lowest = min(lowest, engine.snapshot().datasets[0].effective_concurrency)
    return lowest, await task


async def test_429_storm_lowers_effective_concurrency(tmp_path):
    async with SimServer(SimConfig(seed=4, faults={"429": 0.6}, retry_after_s=0.05, fixed_latency_s=0.05,
                                   mean_completion_tokens=50), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 150, "concurrency": 40}],
                          tables={"engine": {"max_attempts": 30}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        lowest, _state = await run_watching_concurrency(engine, 40)
    assert lowest < 40
    accounted(cfg, engine)


@pytest.mark.parametrize("kind,lowered", [("openai-compatible", True), ("openrouter", False)])
async def test_a_self_hosted_503_lowers_the_concurrency_as_a_429_does(tmp_path, kind, lowered):
    """vLLM and SGLang answer a full queue with 503: from a self-hosted server it cuts the concurrency
    like a 429; OpenRouter's 503 (its routing found no provider) keeps it."""
    async with SimServer(SimConfig(seed=4, faults={"503": 0.6}, retry_after_s=0.05, fixed_latency_s=0.05,
                                   mean_completion_tokens=50), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 150, "concurrency": 40}],
                          tables={"api": {"kind": kind}, "engine": {"max_attempts": 30}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        lowest, state = await run_watching_concurrency(engine, 40)
        assert state == snap.RunState.DONE
    assert (lowest < 40) == lowered
    assert len(RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()) == 150


def test_backoff_is_full_jitter_and_honours_retry_after():
    rng = random.Random(0)
    delays = [backoff_delay(3, 1.0, 60.0, None, rng) for _ in range(500)]
    assert 0 <= min(delays) < 0.5 and 3.5 < max(delays) <= 4.0
    assert all(backoff_delay(1, 1.0, 60.0, 7.0, rng) >= 7.0 for _ in range(50))
    assert max(backoff_delay(30, 1.0, 60.0, None, rng) for _ in range(200)) <= 60.0


@pytest.mark.slow
async def test_two_thousand_really_in_flight(tmp_path):
    # Answers are held until 2,000 are in flight (60 s at most), so a loaded machine admitting
    # slowly cannot make this fail, while a pool capped below 2,000 still does.
    sim_cfg = SimConfig(seed=1, fixed_latency_s=0.2, mean_completion_tokens=20, hold_until_in_flight=2000)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2000, "concurrency": 2000}])
        engine, state, _ = await run_engine(cfg)
        peak = sim.stats.peak_in_flight
    assert state == snap.RunState.DONE
    assert peak >= 0.98 * 2000, peak


def test_a_trickle_of_429s_at_a_high_rate_is_not_a_storm():
    """2,000 in flight, answers in 20 ± 10 s (about 100 attempts a second) and 1% of the attempts 429'd
    at random for ten minutes, starting with the first 2,000 sent at once (their 429s back before any
    answer): the limit is never cut and nothing is said; then a storm (every attempt 429'd) cuts it."""
    rng = random.Random(7)
    clock = [0.0]
    said: list[str] = []
    aimd = AdaptiveConcurrency(2000, clock=lambda: clock[0], on_change=lambda c: said.append(c.text()))

    def send() -> None:
        aimd.on_send()
        if rng.random() < 0.01:
            aimd.on_429()

    for _ in range(2000):
        send()
    lowest = aimd.limit
    for _second in range(600):
        for _ in range(100):
            clock[0] += 0.01
            send()
        aimd.tick()
        lowest = min(lowest, aimd.limit)
    assert lowest == 2000 and said == []
    for _ in range(200):  # then every attempt is a 429 for a second: a storm
        clock[0] += 0.005
        aimd.on_send()
        aimd.on_429()
    assert aimd.limit == 1400 and aimd.in_storm and len(said) == 1


def test_429s_of_a_burst_that_come_back_late_are_not_a_storm():
    """2,000 attempts sent at once, their 1% of 429s back over the next 6 to 9 s (a loaded server: the
    operator run's start, where 10 429s met 174 attempts sent in their window and the limit was cut to
    1,400), a few attempts sent meanwhile: each 429 counts at its attempt's time, so no storm is said and
    the limit stays; 429s of attempts sent now still make one."""
    clock = [0.0]
    said: list[str] = []
    aimd = AdaptiveConcurrency(2000, clock=lambda: clock[0], on_change=lambda c: said.append(c.text()))
    burst = [aimd.on_send() for _ in range(2000)]
    for i in range(20):  # the burst's 429s, late, among 30 attempts sent a second
        clock[0] = 6.0 + i * 0.15
        for _ in range(5):
            aimd.on_send()
        aimd.on_429(burst[i * 100])
        aimd.tick()
    assert aimd.limit == 2000 and said == []
    for _ in range(20):  # 429s of attempts sent now, all of them: a storm
        clock[0] += 0.01
        aimd.on_429(aimd.on_send())
    assert aimd.limit == 1400 and len(said) == 1


async def test_a_stop_now_releases_what_each_abandoned_request_held(tmp_path):
    """Each request's slot, token estimate and reservation go back when its task ends, also when stop
    now cancels it (before its first step or mid-request): the request's done callback, not its body."""
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.5, mean_completion_tokens=50), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 12,
                                                    "token_budget": 1_000_000}])
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        ds = engine.datasets["a"]
        while engine.in_flight < 12:
            await asyncio.sleep(0.01)
        assert ds.token_budget.in_flight > 0 and engine.spend.reserved_usd > 0
        engine.stop()
        assert await asyncio.wait_for(task, 10) == snap.RunState.STOPPED
    assert (ds.in_flight, ds.parked, ds.token_budget.in_flight, ds.doubts.probe_out) == (0, 0, 0, False)
    assert engine.spend.reserved_usd == 0
    assert ds.done + ds.left == 60 and ds.left >= 12, "the abandoned prompts stay eligible"


async def test_a_request_that_ends_on_the_engines_own_error_is_said_with_its_cause(tmp_path, monkeypatch):
    """A bug in the request path (here: the attempt raising for one prompt) fails nothing on disk, the
    prompt is not asked again this run, and an error event names the prompt and the cause."""
    from draftgen.core.generate.loop.request import Request
    attempts = Request.attempts

    async def broken(self):  # type: ignore[no-untyped-def]
        if self.prompt.id == "a-3":
            raise RuntimeError("a bug of the engine's own")
        return await attempts(self)
    monkeypatch.setattr(Request, "attempts", broken)
    events: list[tuple[str, str, str]] = []
    async with SimServer(SimConfig(seed=5, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 6}])
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        await asyncio.wait_for(engine.run(), 30)
    said = [msg for level, kind, msg in events if kind == EventKind.REQUEST_ERROR]
    assert said == ["a: prompt 'a-3' not asked again this run: the engine's own error RuntimeError: "
                    "a bug of the engine's own"]
    assert engine.datasets["a"].done == 5
