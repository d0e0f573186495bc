"""Money you can trust: max_usd as a hard ceiling (billed by the simulator, not as the engine thinks),
every billed cent on the spend ledger, the balance with an ordinary key, the whole-run projection."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from draftgen.core.errors import ConfigError
from draftgen.core.generate.api.prices import Endpoint, Prices, allowed, dataset_prices, prompt_token_bound
from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.forecast import DatasetFigures, SmokeFigures, forecast
from draftgen.core.generate.money.reconcile import reconcile, running_left_s
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.generate.money.unknown import due_unknown, settle_from_key
from draftgen.core.rundir import RunDir
from draftgen.simulator import FAULT_KINDS, SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until

ROUTING = {"ignore": ["fireworks", "baseten"], "sort": "price", "allow_fallbacks": True, "quantizations": ["int4"]}
# The worst prices of the listing under ROUTING (Together's), set as [api] prices where the simulator holds every
# answer until 2,000 are in flight: prices from the listing would start the run with a first wave of 4 requests
# until a bill checks them (core/generate/money/trust.py), which that hold would stall for its 60 s.
LISTED_WORST = {"prompt_price_per_mtok": 0.60, "completion_price_per_mtok": 3.00}


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


async def _run(cfg, **kw) -> Engine:
    engine = Engine(cfg, TEST_KEY, seed=1, **kw)
    await engine.run()
    return engine


# -- prices --------------------------------------------------------------------------------------


def test_routing_filters_the_listing_and_the_worst_price_wins(tmp_path):
    eps = [Endpoint("DeepInfra", "deepinfra/int4", "int4", 0.45e-6, 2.25e-6),
           Endpoint("Together", "together/int4", "int4", 0.60e-6, 3.00e-6),
           Endpoint("Fireworks", "fireworks/fp4", "fp4", 0.90e-6, 9.00e-6),
           Endpoint("Baseten", "baseten", "int4", 0.95e-6, 9.50e-6)]
    assert {e.provider for e in allowed(eps, ROUTING)} == {"DeepInfra", "Together"}
    assert {e.provider for e in allowed(eps, {"only": ["deepinfra"]})} == {"DeepInfra"}
    assert {e.provider for e in allowed(eps, {"quantizations": ["fp4"]})} == {"Fireworks"}
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 1, "max_tokens": 1000}],
                      request={"provider": ROUTING})
    p = dataset_prices(cfg, cfg.datasets[0], eps)
    assert p is not None and p.completion == pytest.approx(3.0e-6) and p.prompt == pytest.approx(0.6e-6)
    assert p.worst_case(100, 1000) == pytest.approx(100 * 0.6e-6 + 1000 * 3e-6)
    # The bound never undercounts: every token of a byte-level BPE covers at least one byte.
    assert prompt_token_bound([{"role": "user", "content": "héllo wörld"}]) >= len("héllo wörld".encode())


async def test_max_usd_without_any_price_refuses_to_start(tmp_path):
    async with SimServer(SimConfig(seed=1, models=("someone/else",)), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5}], tables={"budget": {"max_usd": 1.0}})
        with pytest.raises(ConfigError, match="prompt_price_per_mtok"):
            await _run(cfg)
        assert sim.stats.requests_total == 0
    # Prices from the config (for servers without the listing) win over the listing when set.
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5}],
                          tables={"budget": {"max_usd": 1.0},
                                  "api": {"prompt_price_per_mtok": 1.0, "completion_price_per_mtok": 4.0}})
        engine = await _run(cfg)
    assert dataset_row(engine, "a").done == 5
    prices = engine.prices["a"]
    assert prices is not None and prices.source.startswith("config") and prices.completion == pytest.approx(4e-6)


# -- the ceiling -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_ceiling_holds_with_2000_in_flight_long_answers_and_every_fault(tmp_path):
    # Answers near max_tokens (some cut at it), 2,000 in flight, every fault kind.
    # 429s rare enough that AIMD (three within 2 s) does not cut the 2,000 while they ramp up.
    faults = {kind: 0.0005 if kind == "429" else 0.004 for kind in FAULT_KINDS}
    # Chunks of 64 tokens: the same answers in fewer SSE events, so the suite spends its time on the
    # money, not on parsing. The answers' length in tokens is what the ceiling is about, not how long they
    # take: at latency_scale 0.075 (up to ~10 s an answer, the slow replicas) the run's tail of answers
    # admitted as the room frees up ends in half the wall time, with the same 2,000 in flight (held).
    sim_cfg = SimConfig(seed=7, latency_scale=0.075, mean_completion_tokens=900, length_sigma=0.3, faults=faults,
                        hang_s=5.0, retry_after_s=0.05, stream_chunk_tokens=64,
                        hold_until_in_flight=2000)  # reach 2,000 in flight however slowly the machine admits
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 4000, "concurrency": 2000, "max_tokens": 1024}],
                          tables={"budget": {"max_usd": 7.0},
                                  "api": {"stream": True, "request_timeout_s": 30, "generation_lookup_s": 5,
                                          **LISTED_WORST}},
                          request={"temperature": 0.6, "include_reasoning": True, "provider": ROUTING})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        peak = 0
        while not task.done():
            peak = max(peak, engine.in_flight)
            await asyncio.sleep(0.05)
        await task
        report = await reconcile(cfg, TEST_KEY, lookup_s=10)
        stats = sim.stats
    billed = stats.billed_usd
    r = report.reconciliation
    print(f"billed ${billed:.4f}, ledger ${r.total_usd:.4f}, peak in flight {peak} (simulator {stats.peak_in_flight}), "
          f"faults {stats.faults}, pending {r.pending}, unknown {r.unknown} (<= ${r.unknown_worst_usd:.4f})")
    assert billed <= 7.0
    assert billed >= 0.8 * 7.0                  # the ceiling is used, not stopped early by a pessimistic guess
    assert peak >= 1900
    assert all(stats.faults.get(k, 0) for k in FAULT_KINDS), stats.faults
    # Streamed, every attempt's id comes with its headers: each is priced exactly from its record (an
    # error inside a 200 at 0), so nothing is left pending. Only an attempt cut before its headers has
    # no id: it counts at its worst case (the ceiling stays safe) and is all the difference.
    assert r.pending == 0
    assert r.total_usd <= billed + 1e-4
    assert billed <= r.total_usd + r.unknown_worst_usd + 1e-4
    assert r.unknown_worst_usd < 0.01 * billed
    assert dataset_row(engine, "a").skipped > 0


@pytest.mark.slow
async def test_abandoned_plain_requests_are_billed_in_full_and_held_at_their_worst_case(tmp_path):
    # Not streamed: the headers (and the generation id) come with the whole answer, so a request the
    # client gives up on has no id to look up, runs on at the provider and is billed in full. The ledger
    # keeps it at its worst case until the key's usage prices it (api.request_timeout_s after it was given
    # up on): the ceiling holds, at the price of using less of it meanwhile (which is why streaming is the
    # default against OpenRouter).
    sim_cfg = SimConfig(seed=3, latency_scale=0.05, mean_completion_tokens=300, faults={"drop": 0.05, "hang": 0.05},
                        hang_s=1.0)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 300, "concurrency": 64, "max_tokens": 1024}],
                          tables={"budget": {"max_usd": 0.5},
                                  "api": {"stream": False, "request_timeout_s": 0.6, "generation_lookup_s": 2}})
        engine = await _run(cfg)
        report = await reconcile(cfg, TEST_KEY, lookup_s=2)
        # The abandoned generations run to their end and are billed.
        await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0, "the billing to end")
        billed = sim.stats.billed_usd
    r = report.reconciliation
    # Attempts given up on before their headers had no id to look up: each counted at its worst case until
    # the key's usage priced it, by the run or by `reconcile` (which of them depends on how long after the
    # run it came: a timing this test leaves free, so it counts both).
    lines = [orjson.loads(line) for line in RunDir(cfg.run_dir).spend.read_bytes().splitlines()]
    from_key = sum(1 for x in lines if x.get("e") == "settle" and x.get("s") == "key usage")
    assert r.unknown + from_key > 0
    assert billed <= 0.5 and r.committed_usd <= 0.5
    # Priced from the key's usage, the unknowns bring the ledger to the bill: equal but for the float
    # sums' last bits, in either order.
    assert r.total_usd <= billed + 1e-9 and billed <= r.total_usd + r.unknown_worst_usd + 1e-9
    assert engine.spend.reserved_usd == 0.0


def test_a_killed_run_leaves_its_attempts_pending_at_their_worst_case(tmp_path):
    path = tmp_path / "spend.jsonl"
    lines = [{"e": "sent", "a": "r1-1", "ds": "a", "p": "q1", "w": 0.01, "t": 1},
             {"e": "gen", "a": "r1-1", "g": "gen-1"},
             {"e": "end", "a": "r1-1", "o": "answered", "c": 0.004, "s": "usage.cost"},
             {"e": "sent", "a": "r1-2", "ds": "a", "p": "q2", "w": 0.01, "t": 1},
             {"e": "gen", "a": "r1-2", "g": "gen-2"},
             {"e": "sent", "a": "r1-3", "ds": "a", "p": "q3", "w": 0.02, "t": 1}]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines) + b'{"e":"sent","a":"r1-4"')
    ledger = SpendLedger(path)
    assert ledger.open() > 0  # the torn line is cut
    assert ledger.settled_usd == pytest.approx(0.004)
    assert ledger.pending_usd == pytest.approx(0.03) and ledger.committed_usd == pytest.approx(0.034)
    assert [p.gen for p in ledger.lookups()] == ["gen-2"]
    ledger.settle(ledger.lookups()[0], 0.002)
    ledger.close()
    again = SpendLedger.read(path)
    r = again.reconcile()
    assert (r.answered, r.abandoned_settled, r.unknown) == (1, 1, 1)
    assert again.spent_usd == pytest.approx(0.004 + 0.002 + 0.02)


# -- balance and smoke -------------------------------------------------------------------------


async def test_smoke_passes_with_an_ordinary_key_and_no_key_cap(tmp_path, monkeypatch):
    sim_cfg = SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=60, management_keys=("sk-or-v1-management",),
                        key_limit_usd=None)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "max_tokens": 800},
                                                   {"name": "b", "n": 20, "max_tokens": 400}],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(_tokenizer())}},
                          request={"temperature": 0.6, "include_reasoning": True, "provider": ROUTING})
        result = await run_smoke(cfg, TEST_KEY)
        rows = {r.check: r for r in result.rows}
        assert result.passed, result.rows
        assert rows["balance"].warning and "unknown" in rows["balance"].detail
        assert "not a management key" in rows["balance"].detail
        assert "worst of 4 of 6 providers" in rows["a: prices"].detail
        assert result.projection is not None and 0 < result.projection.total_usd <= 5.0
        # With the management key, /credits gives the balance.
        monkeypatch.setenv("DG_MGMT", "sk-or-v1-management")
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "max_tokens": 800}],
                          tables={"api": {"management_key_env": "DG_MGMT"},
                                  "tokenizer": {"path": str(_tokenizer())}})
        result = await run_smoke(cfg, TEST_KEY)
        rows = {r.check: r for r in result.rows}
        assert rows["balance"].passed and not rows["balance"].warning and "(credits)" in rows["balance"].detail
        # A key with a cap: /key's limit_remaining is the balance.
        sim.update(key_limit_usd=20.0)
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "max_tokens": 800}],
                          tables={"tokenizer": {"path": str(_tokenizer())}})
        result = await run_smoke(cfg, TEST_KEY)
        assert result.balance_usd is not None and 19.0 < result.balance_usd <= 20.0


def _tokenizer():
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    return bundled_kimi_path()


# -- projection --------------------------------------------------------------------------------


def test_projection_covers_datasets_not_started():
    prices = Prices(0.6e-6, 3e-6, 0.0, "test")
    started = DatasetFigures("a", remaining=1800, max_tokens=4096, concurrency=100, token_budget_left=None,
                             answers=200, completion_tokens=200 * 1000, cost_usd=200 * 0.003, prices=prices)
    unstarted = DatasetFigures("b", remaining=2000, max_tokens=8192, concurrency=100, token_budget_left=None,
                               prices=prices)
    plan = forecast([started, unstarted], spent_usd=0.6, max_usd=None, tokens_per_s=10_000, running_concurrency=100)
    a, b = plan.datasets
    assert a.basis == "observed" and a.cost_usd == pytest.approx(1800 * 0.003)
    assert b.basis == "other datasets" and b.tokens_per_answer == pytest.approx(1000)
    assert b.low_usd <= b.cost_usd <= b.high_usd and b.high_usd >= 2000 * 8192 * 3e-6 * 0.99
    assert plan.total_usd == pytest.approx(0.6 + a.cost_usd + b.cost_usd)
    assert plan.time_s == pytest.approx((1800 * 1000 + 2000 * 1000) / 10_000)
    capped = forecast([started, unstarted], spent_usd=0.6, max_usd=5.0, smoke=SmokeFigures(200, 0.0006, 2.0))
    assert capped.total_usd == 5.0 and capped.capped


async def test_snapshot_and_headless_line_show_spend_reserved_and_ceiling(tmp_path):
    from draftgen.headless.printer import detail_lines, status_line
    async with SimServer(SimConfig(seed=5, latency_scale=0.05, mean_completion_tokens=300), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 50, "max_tokens": 512},
                                                   {"name": "b", "n": 100, "concurrency": 20, "max_tokens": 512}],
                          tables={"budget": {"max_usd": 0.05}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        seen = []
        while not task.done():
            await asyncio.sleep(0.1)
            seen.append(engine.snapshot())
        await task
    assert any(s.credits.in_flight_usd > 0 for s in seen)
    assert any(s.credits.ceiling_limited for s in seen)
    mid = next(s for s in seen if s.credits.projected_total_usd is not None and s.datasets[1].done == 0)
    assert mid.datasets[1].total == 100  # counted before it starts, so the projection covers it
    line = status_line(seen[-1])
    assert "spent $" in line and " rsv/$0.05" in line
    assert any("/ reserved $" in d and "/ ceiling $0.05" in d for d in detail_lines(seen[-1]))
    assert RunDir(cfg.run_dir).spend.exists()


# -- kill -9 -----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_sigkills_mid_run_never_let_the_next_run_pass_the_ceiling(tmp_path):
    """A headless run killed with SIGKILL three times mid-run, then run to the end: the attempts each
    killed run left open count at their worst case in the next, and are priced from their records.
    Each kill comes once the run billed a third of what the ceiling leaves it (at most $1): the attempts
    a kill catches without a generation id keep their worst case until the key's usage prices them,
    api.request_timeout_s after they were sent (more of them on a loaded machine), and a run left no room
    ends LIMITED on its own before any fixed bill (correctly)."""
    import os
    import signal
    import sys

    # 2,000 in flight (the ceiling leaves room for them), every fault kind, drops and hangs included:
    # ~15 of each over the ~5,000 requests (at 0.0005 a loaded run drew no 429 at all), a trickle that
    # never cuts the concurrency (AdaptiveConcurrency waits for 429s to be 5% of the attempts sent).
    faults = dict.fromkeys(FAULT_KINDS, 0.003)
    # The wait before the key's usage may price the unknown attempts is api.request_timeout_s past the last
    # one sent (running_left_s): 20 s, and answers of at most ~7 s (latency_scale 0.05, the slowest replica
    # at 1,024 tokens), so the timeout keeps the ~13 s margin it had at 30 s and latency_scale 0.1 for the
    # first run's hold until 2,000 are in flight and a busy machine: no attempt ends by the client's timeout.
    sim_cfg = SimConfig(seed=11, latency_scale=0.05, mean_completion_tokens=700, length_sigma=0.4,
                        faults=faults, hang_s=5.0, retry_after_s=0.05, stream_chunk_tokens=64,
                        hold_until_in_flight=2000)  # the first run reaches 2,000 in flight on a busy machine too
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 6000, "concurrency": 2000, "max_tokens": 1024}],
                          tables={"budget": {"max_usd": 8.0},
                                  "api": {"stream": True, "request_timeout_s": 20, "generation_lookup_s": 5,
                                          **LISTED_WORST},
                                  "engine": {"reconstruct": False}},
                          request={"temperature": 0.6, "include_reasoning": True, "provider": ROUTING})

        async def start() -> asyncio.subprocess.Process:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
                "--interval", "0.5", env={**os.environ, "DG_TEST_KEY": TEST_KEY},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)

        kills, steps = 0, []
        for _step in range(3):
            # What the next run may bill: the ceiling less the bill so far (the attempts left open with an
            # id are looked up at what they were billed) and the worst case of those without one.
            await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0,
                        "the killed run's requests to end")
            unknown_worst = SpendLedger.read(RunDir(cfg.run_dir).spend).reconcile().unknown_worst_usd
            room = 8.0 - sim.stats.billed_usd - unknown_worst
            proc = await start()
            target = sim.stats.billed_usd + min(1.0, room / 3)
            while sim.stats.billed_usd < target and proc.returncode is None:
                await asyncio.sleep(0.05)
            killed_at_in_flight = sim.stats.in_flight
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
            steps.append(f"room ${room:.2f} exit {await proc.wait()}")
        proc = await start()
        # max_usd leaves prompts unasked: the run ends LIMITED, exit 3 (incomplete), not 0.
        assert await asyncio.wait_for(proc.wait(), 240) == 3
        report = await reconcile(cfg, TEST_KEY, lookup_s=5)
        await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0, "the billing to end")
        billed = sim.stats.billed_usd
        # The attempts a kill caught before their headers were read have no generation id; this key
        # ran nothing else, so the key's usage prices them, once none can still be running.
        await asyncio.sleep(running_left_s(SpendLedger.read(RunDir(cfg.run_dir).spend), 20) + 0.1)
        by_key = await reconcile(cfg, TEST_KEY, lookup_s=5, unknown_from_key=True)
    r, k = report.reconciliation, by_key.reconciliation
    print(f"kills {kills}: billed ${billed:.4f}, ledger ${r.total_usd:.4f}, unknown {r.unknown} "
          f"(<= ${r.unknown_worst_usd:.4f}), pending {r.pending}, peak in flight {sim.stats.peak_in_flight}, "
          f"{killed_at_in_flight} in flight at the last kill, steps {steps}, faults {sim.stats.faults}; "
          f"with the key's usage: ledger ${k.total_usd:.4f} ({by_key.from_key_note})")
    assert kills == 3 and r.pending == 0
    assert sim.stats.peak_in_flight >= 1900
    assert all(sim.stats.faults.get(kind, 0) for kind in FAULT_KINDS), sim.stats.faults
    assert billed <= 8.0
    # Every attempt whose id came back is priced exactly; the unknown ones count at their worst case.
    assert r.total_usd <= billed + 1e-4 <= r.total_usd + r.unknown_worst_usd + 2e-4
    if r.unknown == 0:
        assert r.total_usd == pytest.approx(billed, abs=1e-4)
    else:
        assert by_key.from_key_usd is not None and k.unknown == 0
    assert k.total_usd == pytest.approx(billed, abs=1e-4)


def test_unknown_attempts_are_priced_from_the_key_at_most_at_their_worst_case(tmp_path):
    path = tmp_path / "spend.jsonl"
    ledger = SpendLedger(path)
    ledger.open()
    ledger.set_key_baseline(5.0)   # the key had spent $5 before this directory's first attempt
    ledger.close()
    lines = [{"e": "sent", "a": "r1-1", "ds": "a", "p": "q1", "w": 0.01, "t": 1},
             {"e": "end", "a": "r1-1", "o": "answered", "c": 0.004, "s": "usage.cost"},
             {"e": "sent", "a": "r1-2", "ds": "a", "p": "q2", "w": 0.01, "t": 1},    # killed: no id
             {"e": "sent", "a": "r1-3", "ds": "a", "p": "q3", "w": 0.03, "t": 1}]    # killed: no id
    with open(path, "ab") as f:
        f.write(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    again = SpendLedger(path)
    again.open()
    assert again.key_baseline == 5.0 and again.reconcile().unknown == 2
    again.set_key_baseline(7.0)    # not the directory's first run: the baseline stays
    assert again.key_baseline == 5.0
    # The key shows more than the ledger's known costs plus every unknown attempt's worst case: it ran
    # other work; the unknown attempts count their worst case, no more.
    assert settle_from_key(again, due_unknown(again, 10.0), 5.0 + 0.004 + 0.05) == pytest.approx(0.04)
    again.close()
    r = SpendLedger.read(path).reconcile()
    assert r.unknown == 0 and r.total_usd == pytest.approx(0.044)
    assert r.abandoned_settled == 2 and r.abandoned_settled_usd == pytest.approx(0.04)


async def test_smoke_projection_and_the_running_engine_agree(tmp_path):
    async with SimServer(SimConfig(seed=6, fixed_latency_s=1.5, mean_completion_tokens=300), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 20, "max_tokens": 2048},
                                                   {"name": "b", "n": 300, "concurrency": 10, "max_tokens": 4096}],
                          tables={"budget": {"max_usd": 50.0}, "tokenizer": {"path": str(_tokenizer())}},
                          request={"temperature": 0.6, "include_reasoning": True, "provider": ROUTING})
        result = await run_smoke(cfg, TEST_KEY)
        assert result.projection is not None
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        first = None
        while first is None:
            await asyncio.sleep(0.02)
            s = engine.snapshot()
            if all(d.total for d in s.datasets) and s.credits.projected_total_usd is not None:
                first = s
        engine.stop()
        await task
    assert sum(d.done for d in first.datasets) == 0  # before any answer: the same figures on both sides
    assert first.credits.projected_total_usd == pytest.approx(result.projection.total_usd, rel=1e-9)
    assert first.throughput.eta_s is None  # no ETA from the smoke pace alone: "—" until it is stable
    assert (first.credits.projected_low_usd, first.credits.projected_high_usd) == pytest.approx(
        result.projection.range_usd, rel=1e-9)
