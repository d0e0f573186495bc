"""After kill -9s the ledger comes back to the bill: the attempts a killed run left without a generation
id are priced from the key's usage once they cannot still be running (money/unknown.py), by the next
run itself, and a run that max_usd holds back only by them waits for them instead of ending LIMITED.

The simulator bills as OpenRouter does: a non-streamed generation whose client was killed runs on and
is billed in full when it ends, and its GET /key usage shows every charge. Not streamed, its
X-Generation-Id comes with the answer, so every request in flight at a kill is one without an id.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.generate.money.reconcile import reconcile, running_left_s
from draftgen.core.generate.money.spend import Reconciliation, SpendLedger
from draftgen.core.generate.money.unknown import due_unknown, key_share, settle_from_key
from draftgen.core.live.snapshot import RunState
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimProvider, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until
from tests.run.test_disk_faults import FullDisk

MAX_USD = 0.25
TIMEOUT_S = 6.0   # api.request_timeout_s: the unknown attempts of a kill are priced this long after they were sent
LATENCY_S = 2.0   # every generation's: 300 in flight at ~100 answers a second, well inside the timeout
# One provider, cheap enough that 300 requests at 2,048 max_tokens fit at their worst case in what the
# last quarter of max_usd leaves, even with the last kill's unknown attempts still held (~$0.00014 each:
# 300 in flight hold $0.04, 16 % of it; a conversation's later turns little more, their prompts' bound at
# $0.005/M); answers of ~1,000 tokens cost half that.
CHEAP = SimProvider("Cheap", "cheap", "int4", 0.005, 0.065, 1.0, 0.2, 2000.0)


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


def _sim_config(**kw: Any) -> SimConfig:
    return SimConfig(**{"seed": 3, "providers": (CHEAP,), "fixed_latency_s": LATENCY_S, "mean_completion_tokens": 1000,
                        "length_sigma": 0.3, "jitter": 0.0, "fallback_rate": 0.0, **kw})


async def _start(cfg: Any) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
        "--interval", "0.5", env={**os.environ, "DG_TEST_KEY": TEST_KEY},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)


async def _kills_then_finish(sim: SimServer, cfg: Any, at: tuple[float, ...]) -> tuple[int, str, list[str]]:
    """A run killed (kill -9) at each share of max_usd billed in `at`, with 200 or more requests in flight, each
    next run started at once; then a last run to its end. Returns its exit code, its output and what
    each kill caught."""
    steps = []
    # 200, not 300: past 3/4 of max_usd the ceiling holds the run to what is left of it (~250-310 worst cases
    # here), so a wait for 250 could see the run end first on a busy machine.
    for share in at:
        proc = await _start(cfg)
        while (sim.stats.billed_usd < share * MAX_USD or sim.stats.in_flight < 200) and proc.returncode is None:
            await asyncio.sleep(0.02)
        assert proc.returncode is None, (await proc.communicate())[0].decode()[-3000:]
        steps.append(f"killed at ${sim.stats.billed_usd:.4f} billed, {sim.stats.in_flight} in flight")
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    proc = await _start(cfg)
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode or 0, out.decode(), steps


async def _bill_once_every_killed_generation_ended(sim: SimServer) -> float:
    await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0, "the billing to end", 60)
    return sim.stats.billed_usd


async def _crashed(tmp_path: Path, sim: SimServer, dataset: dict[str, Any]) -> tuple[Any, int, str, list[str], float,
                                                                               Reconciliation]:
    """`dataset` run not streamed under max_usd, killed at a quarter, a half and three quarters of it billed,
    then to its end: the config, the last run's exit code and output, the kills, the bill once every
    killed generation ended, and the ledger then."""
    cfg = make_config(tmp_path, sim.base_url, [dataset],
                      tables={"budget": {"max_usd": MAX_USD}, "engine": {"reconstruct": False},
                              "api": {"stream": False, "request_timeout_s": TIMEOUT_S, "generation_lookup_s": 2}})
    code, out, steps = await _kills_then_finish(sim, cfg, (0.25, 0.5, 0.75))
    billed = await _bill_once_every_killed_generation_ended(sim)
    return cfg, code, out, steps, billed, SpendLedger.read(RunDir(cfg.run_dir).spend).reconcile()


def _check(billed: float, ledger: float, unknown: int, what: str) -> None:
    print(f"{what}: billed ${billed:.6f} = {billed / MAX_USD:.2%} of max_usd; ledger ${ledger:.6f} "
          f"= {ledger / billed:.4%} of the bill; {unknown} unknown left")
    assert billed <= MAX_USD + 1e-9  # never more
    assert billed >= 0.8 * MAX_USD
    assert billed - 1e-6 <= ledger <= 1.05 * billed  # never below the bill, within 5 % of it


@pytest.mark.slow
async def test_three_kills_at_300_in_flight_the_last_run_spends_max_usd_and_the_ledger_is_the_bill(tmp_path):
    async with SimServer(_sim_config(), port=0) as sim:
        cfg, code, out, steps, billed, after = await _crashed(
            tmp_path, sim, {"name": "a", "n": 6000, "concurrency": 300, "max_tokens": 2048})
    print(steps)
    # max_usd leaves prompts unasked: LIMITED (exit 3), once the unknown attempts were priced and spent.
    assert code == 3, out[-3000:]
    assert "waits for the key's usage to price them" in out, out[-3000:]
    assert after.unknown == 0 and after.pending == 0, after
    _check(billed, after.committed_usd, after.unknown, "3 kills")


def _conversation(cid: str, n: int) -> dict[str, Any]:
    turns: list[dict[str, str]] = [{"from": "system", "value": "You are a careful assistant."}]
    for k in range(1, n + 1):
        turns += [{"from": "human", "value": f"{cid}: question {k} on topic {cid}"},
                  {"from": "gpt", "value": f"answer {k} of {cid}"}]
    return {"id": cid, "conversations": turns}


@pytest.mark.slow
async def test_a_multi_turn_run_killed_between_turns_spends_max_usd_and_the_ledger_is_the_bill(tmp_path):
    path = tmp_path / "prompts" / "chat.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(orjson.dumps(_conversation(f"c{i}", 5)) + b"\n" for i in range(1000)))
    async with SimServer(_sim_config(), port=0) as sim:
        cfg, code, out, steps, billed, after = await _crashed(
            tmp_path, sim, {"name": "chat", "prompts": "prompts/chat.jsonl", "turns": "all", "concurrency": 300,
                            "max_tokens": 2048})
        turns = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("chat").read_bytes().splitlines() if x]
    print(steps, f"{len(turns)} turns stored, up to turn {max(t['turn'] for t in turns)}")
    assert code == 3, out[-3000:]
    assert max(t["turn"] for t in turns) >= 3  # the kills came between turns of conversations under way
    assert after.unknown == 0 and after.pending == 0, after
    _check(billed, after.committed_usd, after.unknown, "multi-turn, 3 kills")


# -- the figure, line by line --------------------------------------------------------------------


def _ledger(tmp_path: Path, lines: list[dict[str, Any]], baseline: float = 5.0) -> SpendLedger:
    path = tmp_path / "spend.jsonl"
    ledger = SpendLedger(path)
    ledger.open()
    ledger.set_key_baseline(baseline)
    ledger.close()
    with open(path, "ab") as f:
        f.write(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    again = SpendLedger(path)
    again.open()
    return again


def test_unknown_attempts_cost_at_most_the_key_usage_less_what_is_known_exactly_and_their_worst_case(tmp_path):
    ledger = _ledger(tmp_path, [
        {"e": "sent", "a": "r-1", "ds": "a", "p": "q1", "w": 0.01, "t": 1},
        {"e": "end", "a": "r-1", "o": "answered", "c": 0.004, "s": "usage.cost"},   # exact: the key shows it
        {"e": "sent", "a": "r-2", "ds": "a", "p": "q2", "w": 0.01, "t": 1},
        {"e": "end", "a": "r-2", "o": "answered", "c": 0.009, "s": "estimate"},     # may be above the bill
        {"e": "sent", "a": "r-3", "ds": "a", "p": "q3", "w": 0.01, "t": 1},
        {"e": "end", "a": "r-3", "o": "abandoned", "c": None, "s": "pending", "g": "gen-3"},  # still looked up
        {"e": "sent", "a": "r-4", "ds": "a", "p": "q4", "w": 0.01, "t": 1},        # killed: no id
        {"e": "sent", "a": "r-5", "ds": "a", "p": "q5", "w": 0.03, "t": 100}])    # killed: no id, sent later
    assert ledger.exact_usd == pytest.approx(0.004)
    # At t=50 (timeout 10) only r-4 can no longer be running; r-5 is due 60 s later.
    due = due_unknown(ledger, 10.0, now=50.0)
    assert [p.id for p in due.attempts] == ["r-4"] and due.next_s == pytest.approx(60.0)
    # The key ran $0.007 since the baseline: r-4 cost at most 0.007 - 0.004 (the estimate and the pending
    # lookup count $0 there, so the bound only grows)...
    assert key_share(ledger, due, 5.0 + 0.007) == pytest.approx(0.003)
    # ... and never more than its worst case, whatever else the key ran.
    assert key_share(ledger, due, 5.0 + 3.0) == pytest.approx(0.01)
    assert settle_from_key(ledger, due, 5.0 + 0.007) == pytest.approx(0.003)
    assert [p.id for p in ledger.unknown()] == ["r-5"]
    # r-5 next, with r-4 in the group: together at most U - B - exact = 0.02, r-4 holds 0.003 of it.
    later = due_unknown(ledger, 10.0, now=200.0)
    assert settle_from_key(ledger, later, 5.0 + 0.004 + 0.02) == pytest.approx(0.017)
    ledger.close()
    r = SpendLedger.read(tmp_path / "spend.jsonl")
    assert r.key_priced_usd == pytest.approx(0.02) and r.key_priced_worst == pytest.approx(0.04)
    assert r.exact_usd == pytest.approx(0.004) and r.reconcile().unknown == 0


def test_a_key_priced_group_never_drops_below_what_it_was_priced_at(tmp_path):
    # An earlier pricing took $0.008 for r-1 (the key ran other work then); the key now shows less room
    # for the group than it holds: the new attempt gets $0, the ledger keeps the earlier figure.
    ledger = _ledger(tmp_path, [
        {"e": "sent", "a": "r-1", "ds": "a", "p": "q1", "w": 0.01, "t": 1},
        {"e": "settle", "a": "r-1", "c": 0.008, "s": "key usage"},
        {"e": "sent", "a": "r-2", "ds": "a", "p": "q2", "w": 0.01, "t": 1}])
    due = due_unknown(ledger, 10.0, now=50.0)
    assert settle_from_key(ledger, due, 5.0 + 0.006) == 0.0
    assert ledger.reconcile().total_usd == pytest.approx(0.008)
    ledger.close()


def test_without_a_baseline_nothing_is_priced_from_the_key(tmp_path):
    path = tmp_path / "spend.jsonl"
    path.write_bytes(orjson.dumps({"e": "sent", "a": "r-1", "ds": "a", "p": "q1", "w": 0.01, "t": 1}) + b"\n")
    ledger = SpendLedger(path)
    ledger.open()
    assert ledger.key_baseline is None
    assert settle_from_key(ledger, due_unknown(ledger, 10.0, now=50.0), 1.0) is None
    assert ledger.reconcile().unknown == 1
    ledger.close()


async def test_the_ledger_command_prices_unknown_attempts_by_default_once_they_cannot_run(tmp_path):
    """`draftgen ledger` without the flag: a killed run's attempts without an id, priced from the key."""
    async with SimServer(_sim_config(), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 40, "max_tokens": 2048}],
                          tables={"budget": {"max_usd": MAX_USD}, "engine": {"reconstruct": False},
                                  # long enough that the first reconcile surely comes before any is due
                                  "api": {"stream": False, "request_timeout_s": 8.0}})
        proc = await _start(cfg)
        while sim.stats.in_flight < 30 and proc.returncode is None:
            await asyncio.sleep(0.02)
        assert proc.returncode is None
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        early = await reconcile(cfg, TEST_KEY, lookup_s=0)
        assert early.reconciliation.unknown >= 30 and early.from_key_usd is None
        assert "again in" in early.from_key_note and early.from_key_wait_s == 0  # not an error without the flag
        await asyncio.sleep(running_left_s(SpendLedger.read(RunDir(cfg.run_dir).spend), 8.0) + 0.1)
        late = await reconcile(cfg, TEST_KEY, lookup_s=0)
        billed = await _bill_once_every_killed_generation_ended(sim)
    r = late.reconciliation
    assert late.from_key_usd is not None and r.unknown == 0, late.from_key_note
    assert r.total_usd == pytest.approx(billed, abs=1e-9)


# -- answers the ledger missed, a stream's id from its first chunk --------------------------------


async def _generate(cfg: Any, during: Callable[[Pipeline], Awaitable[None]] | None = None) -> RunState:
    """One run of `cfg` in this process (a full disk can be stood in for), `during` it what a test does."""
    pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
    await pipeline.start()
    task = asyncio.create_task(pipeline.generate())
    try:
        if during is not None:
            await during(pipeline)
        return await asyncio.wait_for(task, 60)
    finally:
        await pipeline.close()


async def test_answers_spooled_after_a_full_disk_settle_their_attempts_at_their_recorded_cost(tmp_path, monkeypatch):
    """The disk fills (the ledger's lines refused too) with answers in flight: their answers are held and
    spooled, their attempts stay open on the ledger. The next run imports the spool and settles those
    attempts at the answers' usage.cost, rather than at their worst case for good."""
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(tmp_path / "spool"))
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.3, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 80, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}, "budget": {"max_usd": 5.0}})
        run = RunDir(cfg.run_dir)
        disk = FullDisk(run.root, errno.EROFS)
        monkeypatch.setattr(os, "write", disk)
        held: list[int] = []

        async def fill_the_disk(pipeline: Pipeline) -> None:
            await until(lambda: dataset_row(pipeline.engine, "a").done >= 20, "20 answers")
            disk.full = True
            await until(lambda: pipeline.engine.state == RunState.PAUSED and not pipeline.engine.in_flight,
                        "paused on the read-only disk, its answers held")
            held.append(pipeline.engine.book.held_answers)
            pipeline.quit(drain=False)  # stop now: the held answers go to the spool

        await _generate(cfg, fill_the_disk)
        disk.full = False
        left = SpendLedger.read(run.spend).reconcile()
        assert left.unknown >= held[0], left  # their end lines were refused: open at worst case
        assert await _generate(cfg) == RunState.DONE
        await _bill_once_every_killed_generation_ended(sim)
        billed = sim.stats.billed_usd
    lines = [orjson.loads(x) for x in run.spend.read_bytes().splitlines()]
    from_records = [x for x in lines if x.get("e") == "settle" and x.get("s") == "usage.cost"]
    r = SpendLedger.read(run.spend).reconcile()
    print(f"{held[0]} answers spooled; {len(from_records)} attempts settled from their records; billed ${billed:.6f}, "
          f"ledger ${r.total_usd:.6f}, {r.unknown} unknown")
    assert len(from_records) >= held[0] and all(x["o"] == "answered" for x in from_records)
    assert r.answered == 80  # the spooled answers count as answered when the ledger is read again
    assert r.unknown == 0 and r.pending == 0
    assert r.total_usd == pytest.approx(billed, abs=1e-9)


async def test_a_stream_without_the_generation_id_header_takes_it_from_its_first_chunk() -> None:
    """A stream whose headers carry no X-Generation-Id: the first chunk's `id` (OpenRouter's generation
    id) is heard before the answer ends, so a stream killed after its first bytes can be looked up."""
    from aiohttp import web

    from draftgen.core.generate.api.client import ChatClient

    first_sent = asyncio.Event()
    finish = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "gen-123-abc", "model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        first_sent.set()
        await finish.wait()
        last = {"id": "gen-123-abc", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cost": 0.0001}}
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    heard: list[str] = []
    try:
        async with ChatClient(f"http://127.0.0.1:{port}/v1", "k", concurrency=1) as client:
            ask = asyncio.create_task(client.chat({"model": "m", "messages": [], "stream": True}, heard.append))
            await first_sent.wait()
            await until(lambda: bool(heard), "the first chunk's id heard")
            assert heard == ["gen-123-abc"] and not ask.done()  # before the answer ended
            finish.set()
            answer = await ask
    finally:
        await runner.cleanup()
    assert heard == ["gen-123-abc"] and answer.generation_id == "gen-123-abc"


def test_an_attempt_given_up_on_without_an_id_is_priced_only_a_timeout_after_it_was_given_up_on(tmp_path):
    """A request that timed out before its headers may still be generating when it is given up on: the
    wait for the key's usage runs from then (its end line's "t"), in this process and the next."""
    path = tmp_path / "spend.jsonl"
    ledger = SpendLedger(path)
    ledger.open()
    ledger.set_key_baseline(0.0)
    t = ledger.reserve("a", "q1", 0.01)
    ledger.send(t)
    t.sent_at -= 100.0  # sent 100 s ago, given up on now (a request_timeout_s of 100 s)
    p = ledger.abandoned(t)
    assert p is not None and p.gen is None and p.sent_at >= t.sent_at + 99.0
    assert due_unknown(ledger, 100.0).attempts == []
    ledger.close()
    again = SpendLedger.read(path)
    assert again.unknown()[0].sent_at == pytest.approx(p.sent_at)
    assert due_unknown(again, 100.0).attempts == [] and due_unknown(again, 100.0, now=p.sent_at + 100.0).attempts


@pytest.mark.slow
async def test_a_run_held_back_only_by_unknown_attempts_waits_for_them_and_says_so(tmp_path):
    """The ledger holds all of max_usd in attempts a killed run sent just now without a generation id
    (they never reached the server): the next run sends nothing, says what it waits for, and once they
    cannot still be running prices them from the key's usage ($0 here) and answers every prompt,
    instead of ending LIMITED at once."""
    import time

    async with SimServer(_sim_config(fixed_latency_s=None, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 8, "max_tokens": 2048}],
                          tables={"budget": {"max_usd": 0.01}, "engine": {"reconstruct": False},
                                  "api": {"stream": False, "request_timeout_s": 3.0}})
        run = RunDir(cfg.run_dir)
        run.root.mkdir(parents=True)
        now = time.time()
        lines = [{"e": "key", "u": 0.0, "t": now}] + [
            {"e": "sent", "a": f"dead-{i}", "ds": "a", "p": f"a-{i}", "w": 0.0005, "t": now} for i in range(20)]
        run.spend.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        proc = await _start(cfg)
        out = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
        asked = sim.stats.requests_total
    assert proc.returncode == 0, out[-3000:]
    assert "the run waits for the key's usage to price them" in out, out[-3000:]
    assert "WAITING: max_usd has no room but for 20 attempt(s) without a generation id" in out, out[-3000:]
    r = SpendLedger.read(run.spend).reconcile()
    assert asked == 40 and r.unknown == 0 and r.answered == 40
