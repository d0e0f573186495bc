"""Fault storms through the whole pipeline (engine and live reconstruction with the bundled Kimi
tokenizer) against the simulator: every fault kind at once, a 429 storm, hung requests, and a 402
mid-run that pauses with an alert and resumes when told (in-process, and headless by SIGUSR1).

tests/generate/test_engine.py covers each fault kind alone on the bare engine; these mix them, run the
reconstruction beside them and audit the run directory against the simulator's own counters
(benchmarks/soak.py `audit`): every prompt accounted for once, token files in step with the
answers, and every dollar billed recorded."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from draftgen.core.config import Config
from draftgen.core.generate.api.classify import ANSWER_KINDS
from draftgen.core.live import snapshot as snap
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import FAULT_KINDS, SimConfig, SimServer
from tests.helpers import TEST_KEY, cli_env, dataset_row, make_config, read_ids, until


def _load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("draftgen_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


soak = sys.modules.get("draftgen_soak") or _load_soak()

# Every kind the simulator injects, 40% of requests in all.
MIXED = {kind: 0.4 / len(FAULT_KINDS) for kind in FAULT_KINDS}


def config_for(tmp_path: Path, base_url: str, datasets: list[dict[str, Any]], *, api: dict[str, Any] | None = None,
               engine: dict[str, Any] | None = None) -> Config:
    tables = {"api": {"request_timeout_s": 5, **(api or {})},
              "engine": {"reconstruct": True, "workers": 1, **(engine or {})},
              "tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}}
    return make_config(tmp_path, base_url, datasets, tables=tables)


def clean_audit(config: Config, sim: SimServer, **kw: Any) -> Any:
    """The soak's audit of a run that was never killed: every answer delivered is written; the
    only generations billed and unwritten are those nobody could read (drops, hangs, truncated
    bodies, which the service bills: docs/openrouter.md, "Billing")."""
    st = sim.stats
    a = soak.audit(config, st, sample=20, **kw)
    assert a.problems == []
    assert a.duplicates == 0 and a.served_unwritten == st.generations_billed - st.answers_total
    assert a.served_unwritten == sum(st.faults.get(k, 0) for k in soak.BILLED_FAULTS)
    assert a.recorded_usd + a.served_unwritten_usd == pytest.approx(a.billed_usd, rel=1e-9, abs=1e-12)
    assert a.token_entries == a.answered and a.sample_mismatch == 0
    return a


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_every_fault_kind_at_once_through_the_pipeline(tmp_path: Path, stream: bool) -> None:
    async with SimServer(SimConfig(seed=11, latency_scale=0.0, mean_completion_tokens=60, faults=MIXED,
                                   retry_after_s=0.01, hang_s=120), port=0) as sim:
        config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": 240, "concurrency": 24},
                                                     {"name": "b", "n": 60, "concurrency": 8}],
                            api={"request_timeout_s": 1.0, "stream": stream}, engine={"max_attempts": 4})
        pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        try:
            state = await asyncio.wait_for(pipeline.generate(), 120)
            s = pipeline.snapshot()
        finally:
            await pipeline.close()
        faults = sim.stats.faults
    assert state == snap.RunState.DONE
    assert all(faults.get(kind, 0) > 0 for kind in FAULT_KINDS), faults
    a = clean_audit(config, sim)
    assert a.answered + a.failed == a.prompts == 300 and a.skipped == 0
    rd = RunDir(config.run_dir)
    for ds in ("a", "b"):
        # Outage kinds (429, 5xx, connection) never fail a prompt; an answer fault may, after 4
        # attempts spent while other prompts were answered.
        for line in soak.whole_lines(rd.failures(ds))[0]:
            assert line["attempts"] >= 4 and line["error_kind"] in ANSWER_KINDS and line["message"]
    tallied = dict(s.errors)
    # Streamed, a drop comes after the headers: the body is cut (bad_body), no connection error.
    assert {"429", "5xx", "timeout", "bad_body"} | (set() if stream else {"connection"}) <= set(tallied), tallied
    assert s.retries > 0
    tokens = s.stage("tokens")
    assert tokens is not None and tokens.state == "done" and tokens.done == a.answered


# Rows of OpenRouter's table mixed in at rates: prompts of their own that fail, transient answers.
# Scenarios share their draws (one per prompt for a prompt's own problems, one per request for the
# rest) and the first in the order the service meets them answers, so the rates climb: 2% each.
TABLE_MIX = {"payload_too_large": {"rate": 0.02}, "context_length": {"rate": 0.04},
             "invalid_prompt": {"rate": 0.06}, "moderation": {"rate": 0.08},
             "rate_limited": {"rate": 0.04, "retry_after": 0.01}, "request_timeout": {"rate": 0.06},
             "no_provider_503": {"rate": 0.09}, "provider_500": {"rate": 0.11}, "provider_502": {"rate": 0.13},
             "gateway_504": {"rate": 0.15}, "gateway_524": {"rate": 0.17}, "error_body": {"rate": 0.19},
             "finish_error": {"rate": 0.21}, "empty_choices": {"rate": 0.23}, "stream_error": {"rate": 0.25}}
OWN = {"moderated", "400_context_length", "400_invalid_prompt", "413"}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_response_table_mixed_with_faults_and_account_episodes(tmp_path: Path, stream: bool) -> None:
    """Faults and table rows at once, and mid-run a key cap, then the balance, then the in-flight budget:
    the run holds for the account twice and resumes by itself each time (a re-read of /key, /credits),
    and only the prompts' own problems fail prompts."""
    faults = {kind: 0.15 / len(FAULT_KINDS) for kind in FAULT_KINDS}
    async with SimServer(SimConfig(seed=12, fixed_latency_s=0.02, mean_completion_tokens=60, faults=faults,
                                   retry_after_s=0.01, hang_s=120, scenarios=TABLE_MIX), port=0) as sim:
        config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": 240, "concurrency": 16},
                                                     {"name": "b", "n": 60, "concurrency": 6}],
                            api={"request_timeout_s": 1.0, "stream": stream, "credits_interval_s": 0.1},
                            engine={"max_attempts": 4, "parallel": True})
        pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        engine = pipeline.engine
        by_balance = set()  # episodes the balance read held first (the credit floor), before any 402/403 came
        try:
            for episode, answers in (("key_limit", 60), ("out_of_credits", 140)):
                await until(lambda n=answers: sim.stats.answers_total >= n, f"{answers} answers", 60)
                sim.scenario(episode, True)
                await until(lambda: engine.account is not None, f"{episode} to hold the run", 20)
                assert engine.state == snap.RunState.PAUSED and pipeline.snapshot().waiting
                if "credit_floor_usd" in engine.alert:
                    by_balance.add(episode)
                await asyncio.sleep(0.3)
                sim.scenario(episode, False)
                await until(lambda: engine.state == snap.RunState.RUNNING, f"{episode} to clear by itself", 20)
            # A budget for about three requests of 4096 max_tokens: 402s with Retry-After, never one alone too big.
            sim.scenario("in_flight_budget", True, ratio=0.0003, retry_after=0.05, duration=1.0)
            state = await asyncio.wait_for(task, 120)
            s = pipeline.snapshot()
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
        hits = sim.stats.scenarios
    assert state == snap.RunState.DONE
    # Either way of holding is right: a 402/403 answered, or a balance read (every 0.1 s) that showed it first.
    assert set(TABLE_MIX) | {"key_limit", "out_of_credits", "in_flight_budget"} - by_balance <= set(hits), hits
    a = clean_audit(config, sim)
    assert a.answered + a.failed == a.prompts == 300 and a.skipped == 0
    rd = RunDir(config.run_dir)
    kinds = [f["error_kind"] for ds in ("a", "b") for f in soak.whole_lines(rd.failures(ds))[0]]
    assert kinds and all(k in OWN or k in ANSWER_KINDS for k in kinds), kinds
    assert OWN & set(kinds), "the prompts of their own problems fail, with their reason"
    assert sum(1 for e in pipeline.hub.recent if e.kind == "account" and "cleared" in e.message) == 2
    assert s.stage("tokens") is not None and s.stage("tokens").done == a.answered


async def _storm_run(tmp_path: Path, sim: SimServer, n: int, configured: int
                     ) -> tuple[Config, Pipeline, asyncio.Task[str]]:
    """One dataset of `n` prompts at concurrency `configured` against `sim`, started: its config, pipeline
    and generation task (80 attempts: Retry-After spaces a storm's retries, none runs out)."""
    config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": configured}],
                        engine={"max_attempts": 80})
    pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
    await pipeline.start()
    return config, pipeline, asyncio.create_task(pipeline.generate())


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_429_storm_slows_the_run_and_it_recovers(tmp_path: Path) -> None:
    """A storm of 429s cuts the effective limit, the retries over it park instead of hitting the
    provider, only the requests already out are answered during it, and after it the limit climbs
    back and every prompt is answered. Each point is a state waited for, then asserted (no rates)."""
    configured, n = 40, 1000
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.1, mean_completion_tokens=40, retry_after_s=0.3),
                         port=0) as sim:
        config, pipeline, task = await _storm_run(tmp_path, sim, n, configured)
        # `parked` (retries waiting for a slot under the lowered limit) is the room's own count: no snapshot field.
        run = pipeline.engine.datasets["a"]

        def in_flight() -> int:
            return dataset_row(pipeline.engine, "a").in_flight

        def limit() -> int:
            return pipeline.snapshot().datasets[0].effective_concurrency

        lowest = configured

        async def watch() -> None:  # the lowest limit shown, so the climb is measured from the real bottom
            nonlocal lowest
            while True:
                lowest = min(lowest, limit())
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            await until(lambda: sim.stats.answers_total >= 100, "the run to get going", 60)
            limit_before = limit()
            sim.update(faults={"429": 1.0})  # every request rate-limited, with Retry-After
            answered_at_storm = sim.stats.answers_total
            await until(lambda: limit() <= configured // 2 and sim.stats.faults.get("429", 0) > 2 * configured,
                        "the storm to cut the limit to half", 60)
            # The cut is met at each retry's next attempt: the requests over the limit park, holding no slot.
            await until(lambda: 0 < run.parked and in_flight() - run.parked <= limit(),
                        "the retries over the lowered limit to park", 30)
            parked, taking_part, lowered = run.parked, in_flight() - run.parked, limit()
            # Slow answers while the limit climbs back, so the run cannot end before it has.
            sim.update(faults={}, fixed_latency_s=0.5)
            after_storm = sim.stats.answers_total
            # Additive increase: 5 s without a 429, then a step a second.
            await until(lambda: limit() >= lowest + 2, "the limit to climb back", 60)
            climbed = limit()
            sim.update(fixed_latency_s=0.0)  # finish the rest quickly
            state = await asyncio.wait_for(task, 120)
        finally:
            watcher.cancel()
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE
    assert limit_before == configured
    assert lowered <= configured // 2 and parked > 0 and taking_part <= lowered, (lowered, parked, taking_part)
    # Only the requests already in flight when it started could still be answered.
    assert after_storm - answered_at_storm <= configured, "answers kept landing through a total storm"
    assert climbed >= lowest + 2 and lowest <= configured // 2
    a = clean_audit(config, sim)
    assert a.answered == n and a.failed == 0  # Retry-After spaced the retries: none ran out of attempts
    # The storm is said when it starts (with its cut) and when it ends, in events.log too: not once per cut.
    log = RunDir(config.run_dir).events_log.read_text()
    said = [line for line in log.splitlines() if " concurrency " in line or "429 storm" in line]
    assert sum("a: 429 storm: " in line and "limit cut 40 → 28" in line for line in said) == 1, said
    assert sum("a: 429 storm over after" in line for line in said) == 1, said
    assert len(said) <= 3, said  # start, end, and the limit back at 40 if it got there


async def test_a_steady_trickle_of_429s_never_cuts_the_limit(tmp_path: Path) -> None:
    """1% of the attempts 429'd from the first one on, at 300 in flight: the 429s of the first wave come
    back before any answer, yet the limit stays within 5% of the configured value and no storm is said;
    every prompt is answered once."""
    configured, n = 300, 1200
    async with SimServer(SimConfig(seed=8, fixed_latency_s=0.3, mean_completion_tokens=20, faults={"429": 0.01},
                                   retry_after_s=0.05), port=0) as sim:
        config, pipeline, task = await _storm_run(tmp_path, sim, n, configured)
        lowest = configured
        try:
            while not task.done():
                lowest = min(lowest, pipeline.snapshot().datasets[0].effective_concurrency)
                await asyncio.sleep(0.02)
            state = await task
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE
    assert sim.stats.faults.get("429", 0) >= 5
    assert lowest >= 0.95 * configured, f"a 1% trickle cut the limit to {lowest}"
    assert not [e for e in pipeline.hub.recent if e.kind == "concurrency"]
    assert clean_audit(config, sim).answered == n


async def test_a_drain_sends_no_further_attempt_of_a_retry_waiting_for_a_slot(tmp_path: Path) -> None:
    """Retries parked under a limit a 429 storm lowered are given up by a drain, unrecorded and eligible:
    when the requests still out end and free their slots, none of the parked ones is sent again (only
    the requests out at the drain, at most, reach the server after it)."""
    configured = 40
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.1, mean_completion_tokens=40, retry_after_s=0.3),
                         port=0) as sim:
        config, pipeline, task = await _storm_run(tmp_path, sim, 400, configured)
        run = pipeline.engine.datasets["a"]
        try:
            await until(lambda: sim.stats.answers_total >= 40, "the run to get going", 60)
            sim.update(faults={"429": 1.0})  # every request rate-limited, with Retry-After
            await until(lambda: run.parked >= 3, "retries to park under the lowered limit", 60)
            # The requests out (not parked) that may still reach the server: neither backing off (a drain
            # gives those up when their wait ends) nor already there.
            parked, received = run.parked, sim.stats.requests_total
            on_the_way = run.in_flight - parked - pipeline.engine.backing_off - sim.stats.in_flight
            pipeline.quit(drain=True)
            state = await asyncio.wait_for(task, 60)
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DRAINED, state
    sent_after = sim.stats.requests_total - received
    assert sent_after <= max(0, on_the_way), f"{sent_after} reached the server after the drain ({parked} parked)"
    assert run.in_flight == 0 and run.parked == 0


async def test_a_paused_run_sends_nothing_retries_included(tmp_path: Path) -> None:
    """A pause under a 429 storm: the requests in flight at the pause end (answered, or handed back when
    they would retry) and from then on not one request reaches the server while the run stays paused,
    however many Retry-After periods pass; each request out at the pause reaches it at most once more.
    After the resume every prompt is answered once."""
    configured, n = 40, 300
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.05, mean_completion_tokens=40, retry_after_s=0.05),
                         port=0) as sim:
        config, pipeline, task = await _storm_run(tmp_path, sim, n, configured)
        try:
            await until(lambda: sim.stats.answers_total >= 40, "the run to get going", 60)
            sim.update(faults={"429": 1.0})  # every attempt from now on must be retried
            await until(lambda: sim.stats.faults.get("429", 0) >= configured, "requests to be retrying", 60)
            out, received = pipeline.engine.in_flight, sim.stats.requests_total
            pipeline.pause()
            await until(lambda: pipeline.engine.in_flight == 0, "the requests in flight at the pause to end", 30)
            on_the_way = sim.stats.requests_total - received  # attempts already out when it paused
            ended = sim.stats.requests_total
            # Many Retry-After periods (0.05 s) and backoffs: a retry still going on would be sent here.
            await asyncio.sleep(1.5)
            during = sim.stats.requests_total - ended
            paused = pipeline.engine.state
            sim.update(faults={})
            pipeline.resume()
            state = await asyncio.wait_for(task, 120)
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert paused == snap.RunState.PAUSED
    assert during == 0, f"{during} requests reached the server while the run was paused"
    assert on_the_way <= out, (on_the_way, out)
    assert state == snap.RunState.DONE
    a = clean_audit(config, sim)
    assert a.answered == n and a.failed == 0  # the prompts handed back at the pause were asked after it


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_hung_requests_are_cut_by_their_timeout(tmp_path: Path, stream: bool) -> None:
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40, faults={"hang": 0.5},
                                   hang_s=300), port=0) as sim:
        config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 10}],
                            api={"request_timeout_s": 0.5, "stream": stream}, engine={"max_attempts": 3})
        pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        try:
            # Each hang holds for 300 s: the run ends this soon only if every one was cut at 0.5 s.
            state = await asyncio.wait_for(pipeline.generate(), 60)
            s = pipeline.snapshot()
        finally:
            await pipeline.close()
        await until(lambda: sim.stats.in_flight == 0, "the simulator's hung handlers to be let go", 5)
        stats = sim.stats
    assert state == snap.RunState.DONE
    hangs = stats.faults.get("hang", 0)
    assert hangs > 0 and dict(s.errors).get("timeout") == hangs
    assert stats.by_status.get("hang") == hangs  # each hung connection was closed by the client
    failures = soak.whole_lines(RunDir(config.run_dir).failures("a"))[0]
    assert failures and all(f["error_kind"] == "timeout" and "within 0.5 s" in f["message"] for f in failures)
    a = clean_audit(config, sim)
    assert a.answered + a.failed == 40


@pytest.mark.slow
async def test_402_mid_run_pauses_with_an_alert_and_resumes_when_told(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=6, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": 150, "concurrency": 8},
                                                     {"name": "b", "n": 50, "concurrency": 4}])
        pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        try:
            await until(lambda: sim.stats.answers_total >= 40, "40 answers", 60)
            sim.set_balance(0)  # out of credits mid-run
            await until(lambda: pipeline.engine.state == snap.RunState.PAUSED, "the run to pause", 20)
            s = pipeline.snapshot()
            assert s.state == snap.RunState.PAUSED and "out of credits (402)" in s.alert
            assert any(e.kind == "alert" and e.level == "error" and "402" in e.message for e in pipeline.hub.recent)
            # Requests in flight finish and are recorded; nothing new is admitted while paused.
            await until(lambda: pipeline.engine.in_flight == 0, "the requests in flight to finish", 20)
            asked = sim.stats.requests_total
            await asyncio.sleep(0.5)
            assert sim.stats.requests_total == asked and pipeline.engine.state == snap.RunState.PAUSED
            assert pipeline.unavailable("resume") is None
            paused_with = sum(len(read_ids(RunDir(config.run_dir).responses(d))) for d in ("a", "b"))
            sim.set_balance(20)
            pipeline.resume()
            state = await asyncio.wait_for(task, 60)
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE and 40 <= paused_with < 200
    assert any(e.kind == "resumed" for e in pipeline.hub.recent)
    a = clean_audit(config, sim)
    assert a.answered == 200 and a.failed == 0  # the 402'd prompts were asked again, not failed


@pytest.mark.slow
async def test_402_headless_pauses_and_sigusr1_resumes(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=7, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        config = config_for(tmp_path, sim.base_url, [{"name": "a", "n": 300, "concurrency": 8}])
        log_path = tmp_path / "run.log"
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(config.path), "--headless", "--skip-smoke",
                "--interval", "0.2", env=cli_env(), stdout=log,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        events_log = RunDir(config.run_dir).events_log
        try:
            await until(lambda: sim.stats.answers_total >= 40, "40 answers", 60)
            sim.set_balance(0)
            await until(lambda: events_log.exists() and "out of credits (402)" in events_log.read_text(),
                        "the 402 alert in events.log", 20)
            await until(lambda: sim.stats.in_flight == 0, "the requests in flight to finish", 20)
            asked = sim.stats.requests_total
            await asyncio.sleep(0.6)
            assert sim.stats.requests_total == asked, "requests admitted while paused"
            assert proc.returncode is None
            assert "WAITING (PAUSED)" in log_path.read_text() and "ALERT: out of credits (402)" in log_path.read_text()
            sim.set_balance(20)
            os.kill(proc.pid, signal.SIGUSR1)
            code = await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await soak.reap_session(proc.pid, 3.0)
    assert code == 0, log_path.read_text()[-2000:]
    assert "resumed" in events_log.read_text()
    a = clean_audit(config, sim)
    assert a.answered == 300 and a.failed == 0


def _combined(*stats: Any) -> Any:
    """The counters of several simulator lives as one (the audit reads one SimStats)."""
    from draftgen.simulator import SimStats
    out = SimStats()
    for st in stats:
        out.requests_total += st.requests_total
        out.answers_total += st.answers_total
        out.billed_usd += st.billed_usd
        for name in ("faults", "prompt_requests", "prompt_answers", "prompt_cost"):
            mine = getattr(out, name)
            for k, v in getattr(st, name).items():
                mine[k] = mine.get(k, 0) + v
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finish", "drain"])
async def test_an_outage_fails_no_prompt(tmp_path: Path, how: str) -> None:
    """The API goes away mid-run (network down, a local server restarting): connections are refused.
    No prompt may be failed for it; the run waits and goes on when the API is back. A drain during
    the outage ends at once and leaves the prompts in flight eligible for the next run."""
    sim_config = SimConfig(seed=9, fixed_latency_s=0.05, mean_completion_tokens=60)
    first = SimServer(sim_config, port=0)
    await first.start()
    port = first.port
    config = config_for(tmp_path, first.base_url, [{"name": "a", "n": 200, "concurrency": 8}],
                        engine={"max_attempts": 3})
    pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
    await pipeline.start()
    task = asyncio.create_task(pipeline.generate())
    second: SimServer | None = None
    try:
        await until(lambda: first.stats.answers_total >= 40, "40 answers", 60)
        await first.close()  # refused from now on: at 3 attempts every request would fail in well under a second
        gone = first.stats
        await until(lambda: dict(pipeline.snapshot().errors).get("connection", 0) >= 30, "refused connections", 30)
        assert pipeline.engine.state == snap.RunState.RUNNING and not pipeline.snapshot().alert
        if how == "drain":
            pipeline.quit(drain=True)
            state = await asyncio.wait_for(task, 30)
            outcome = soak.read_disk(config)
            # Drained during the outage: what was not answered stays eligible, so the run is not DONE.
            assert state == snap.RunState.DRAINED and outcome.failed["a"] == []
            assert len(outcome.answered["a"]) == gone.answers_total  # what was answered is written
            return
        second = SimServer(sim_config, port=port)
        await second.start()
        state = await asyncio.wait_for(task, 60)
        again = second.stats
    finally:
        if not task.done():
            pipeline.quit(drain=False)
        await pipeline.close()
        await first.close()
        if second is not None:
            await second.close()
    assert state == snap.RunState.DONE
    kinds = [e.kind for e in pipeline.hub.recent]
    assert "unreachable" in kinds and "reachable" in kinds
    a = soak.audit(config, _combined(gone, again), sample=20)
    assert a.problems == [] and a.answered == 200 and a.failed == 0
