"""Money at its edges: the reservation is the body sent, unknown attempts are priced from the
key only once they cannot still run, the smoke test rides out a momentary 429, and one prompt too
costly for what max_usd leaves is skipped while the rest go on."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys

import orjson
import pytest

from draftgen.core.errors import ConfigError
from draftgen.core.generate.api.prices import body_worst_case
from draftgen.core.generate.commands.smoke import SMOKE, run_smoke
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.reconcile import reconcile, running_left_s
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.snapshot import RunState
from draftgen.core.rundir import RunDir, iter_jsonl
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config

ROUTING = {"ignore": ["fireworks", "baseten"], "allow_fallbacks": True, "quantizations": ["int4"]}


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


def _ledger_lines(cfg) -> list[dict]:
    return [line for _, line in iter_jsonl(RunDir(cfg.run_dir).spend)]


# -- finding 4: the body is the reservation ------------------------------------------------------


def test_an_answer_cap_in_a_request_table_must_be_the_datasets(tmp_path):
    url = "http://127.0.0.1:9/api/v1"
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, url, [{"name": "a", "n": 1, "max_tokens": 64}], request={"max_tokens": 8192})
    msg = str(e.value)
    assert "request.max_tokens = 8192" in msg and "datasets[0].max_tokens = 64" in msg and "draftgen.toml" in msg
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.request\.max_completion_tokens = 9000.*max_tokens = 64"):
        make_config(tmp_path, url, [{"name": "a", "n": 1, "max_tokens": 64,
                                     "request": {"max_completion_tokens": 9000}}])
    with pytest.raises(ConfigError, match="request.max_completion_tokens = 100 differs from request.max_tokens = 200"):
        make_config(tmp_path, url, [{"name": "a", "n": 1}], request={"max_tokens": 200, "max_completion_tokens": 100})
    with pytest.raises(ConfigError, match="request.max_tokens must be a positive integer"):
        make_config(tmp_path, url, [{"name": "a", "n": 1}], request={"max_tokens": "lots"})
    # Set only in a request table, it is the dataset's max_tokens (the budgets use it); equal, it is fine.
    cfg = make_config(tmp_path, url, [{"name": "a", "n": 1}, {"name": "b", "n": 1, "request": {"max_tokens": 300}},
                                      {"name": "c", "n": 1, "max_tokens": 8192}], request={"max_tokens": 8192})
    assert [d.max_tokens for d in cfg.datasets] == [8192, 300, 8192]
    assert [cfg.request_body(d, [])["max_tokens"] for d in cfg.datasets] == [8192, 300, 8192]


async def test_the_reservation_is_the_worst_case_of_the_body_sent(tmp_path):
    # The body carries max_tokens 8192 past the config check (as any future path might): the
    # reservation follows the body, not the dataset's 64, and the simulator's bill stays under max_usd.
    sim_cfg = SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=3000, length_sigma=0.2)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 30, "max_tokens": 64}],
                          tables={"budget": {"max_usd": 0.04}, "api": {"stream": False}},
                          request={"temperature": 0.6, "provider": ROUTING})
        ds = dataclasses.replace(cfg.datasets[0], request={"max_tokens": 8192})
        cfg = dataclasses.replace(cfg, datasets=(ds,))
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        billed = sim.stats.billed_usd
    prices = engine.prices["a"]
    assert prices is not None
    sent = [line for line in _ledger_lines(cfg) if line.get("e") == "sent"]
    assert sent
    at_8192 = 8192 * prices.completion
    assert all(line["w"] >= at_8192 for line in sent), (sent[0]["w"], at_8192)
    body = cfg.request_body(ds, [{"role": "user", "content": "Question a-0: explain item 0."}])
    assert sent[0]["w"] == pytest.approx(body_worst_case(prices, body, 64))
    print(f"billed ${billed:.4f} of $0.04, {dataset_row(engine, 'a').done} answered, {len(sent)} sent")
    assert 0 < billed <= 0.04


async def test_the_smoke_test_reserves_and_says_the_cap_the_body_carries(tmp_path):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2}],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(bundled_kimi_path())}},
                          request={"temperature": 0.6, "include_reasoning": True, "max_completion_tokens": 3000,
                                   "provider": ROUTING})
        result = await run_smoke(cfg, TEST_KEY)
    prices_row = next(r for r in result.rows if r.check == "a: prices")
    assert "max_tokens 3000" in prices_row.detail, prices_row.detail
    sent = [line for line in _ledger_lines(cfg) if line.get("e") == "sent" and line["ds"] == SMOKE]
    assert len(sent) == 1 and sent[0]["w"] >= 3000 * 3.0e-6  # the worst completion price the routing allows


# -- finding 5: unknown attempts priced from the key only once they cannot still run -------------


@pytest.mark.slow
async def test_unknown_from_key_waits_until_the_killed_generations_cannot_still_run(tmp_path):
    # Not streamed: a generation whose client was killed runs on and is billed in full when it ends.
    timeout_s = 10.0
    async with SimServer(SimConfig(seed=5, fixed_latency_s=2.5, mean_completion_tokens=200), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 30}],
                          tables={"budget": {"max_usd": 5.0}, "engine": {"reconstruct": False},
                                  "api": {"stream": False, "request_timeout_s": timeout_s}},
                          request={"temperature": 0.6, "provider": ROUTING})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            env={**os.environ, "DG_TEST_KEY": TEST_KEY}, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        while sim.stats.in_flight < 20 and proc.returncode is None:
            await asyncio.sleep(0.02)
        assert proc.returncode is None, f"the run ended (exit {proc.returncode}) before 20 requests were in flight"
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "ledger", str(cfg.path), "--unknown-from-key",
            env={**os.environ, "DG_TEST_KEY": TEST_KEY, "COLUMNS": "400"}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        cli_out = (await cli.communicate())[0].decode()
        assert cli.returncode == 1 and "may still be generating" in cli_out and "again in" in cli_out, cli_out
        early = await reconcile(cfg, TEST_KEY, lookup_s=0, unknown_from_key=True)
        # The generations the kill left running are billed as they end; the ledger still has them at worst.
        r = early.reconciliation
        assert r.unknown >= 20
        assert early.from_key_usd is None and early.from_key_wait_s > 0, early.from_key_note
        assert "again in" in early.from_key_note and "request_timeout_s" in early.from_key_note
        # Once request_timeout_s has passed since the last of them was sent, the key's usage has them all.
        await asyncio.sleep(running_left_s(SpendLedger.read(RunDir(cfg.run_dir).spend), timeout_s) + 0.1)
        while sim.stats.in_flight:
            await asyncio.sleep(0.05)
        late = await reconcile(cfg, TEST_KEY, lookup_s=0, unknown_from_key=True)
        billed = sim.stats.billed_usd
    print(f"unknown {r.unknown} (<= ${r.unknown_worst_usd:.4f}), billed ${billed:.4f}: {early.from_key_note}; "
          f"then {late.from_key_note}")
    assert late.from_key_usd is not None and late.from_key_wait_s == 0
    assert late.reconciliation.unknown == 0
    assert late.reconciliation.total_usd == pytest.approx(billed, abs=1e-6)


# -- finding 9: the smoke test rides out a momentary 429 -----------------------------------------


async def test_smoke_retries_a_429_on_the_ledger_and_passes(tmp_path):
    sim_cfg = SimConfig(seed=1, latency_scale=0.0, scenarios={"rate_limited": {"retry_after": 0.05}})
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2, "max_tokens": 2048}],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(bundled_kimi_path())}},
                          request={"temperature": 0.6, "include_reasoning": True, "provider": ROUTING})
        task = asyncio.create_task(run_smoke(cfg, TEST_KEY))
        while sim.stats.scenarios.get("rate_limited", 0) < 2 and not task.done():
            await asyncio.sleep(0.01)
        sim.scenario("rate_limited", on=False)  # the rate limit was momentary
        result = await task
        hits = sim.stats.scenarios.get("rate_limited", 0)
    assert result.passed, result.summary()
    lines = _ledger_lines(cfg)
    sent = [line for line in lines if line.get("e") == "sent" and line["ds"] == SMOKE]
    ends = {line["a"]: line for line in lines if line.get("e") == "end"}
    assert len(sent) == hits + 1 >= 3
    assert all(line["w"] > 0 for line in sent)  # every retry reserved its worst case
    outcomes = [ends[line["a"]]["o"] for line in sent]
    assert outcomes == ["refused"] * hits + ["answered"]


# -- finding 11: a prompt too costly for what is left is skipped, the rest go on -----------------


@pytest.mark.slow
def test_one_prompt_too_costly_for_max_usd_is_skipped_and_the_run_is_not_complete(tmp_path):
    import subprocess

    async def go() -> tuple[int, str, float]:
        async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=80), port=0) as sim:
            prompts = tmp_path / "prompts" / "a.jsonl"
            prompts.parent.mkdir(parents=True)
            rows = [{"id": f"q{i}", "prompt": f"Question {i}: explain item {i}."} for i in range(12)]
            rows.insert(4, {"id": "huge", "prompt": "word " * 40_000})  # 200 KB: its worst case alone > max_usd
            prompts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            cfg = make_config(tmp_path, sim.base_url,
                              [{"name": "a", "prompts": "prompts/a.jsonl", "concurrency": 2, "max_tokens": 256}],
                              tables={"budget": {"max_usd": 0.05}, "engine": {"reconstruct": False}},
                              request={"temperature": 0.6, "provider": ROUTING})
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
                env={**os.environ, "DG_TEST_KEY": TEST_KEY}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out, _ = await proc.communicate()
            return proc.returncode, out.decode(), sim.stats.billed_usd

    rc, out, billed = asyncio.run(go())
    rd = RunDir(tmp_path / "run")
    answered = {orjson.loads(line)["id"] for line in rd.responses("a").read_bytes().splitlines() if line.strip()}
    failures = rd.failures("a")
    assert answered == {f"q{i}" for i in range(12)}, out
    assert not failures.exists() or b"huge" not in failures.read_bytes()
    assert billed <= 0.05
    assert rc == 3, out
    assert "LIMITED by max_usd" in out and "1 skipped" in out and "exit 3 (incomplete" in out, out
    assert "prompt 'huge' skipped" in out and "raise [budget] max_usd" in out, out


async def test_limited_is_a_final_incomplete_state():
    from draftgen.core.generate.loop.run_state import RunControl
    from draftgen.core.run.life import INCOMPLETE

    class D:
        name, total, done, failed, skipped = "a", 3, 2, 0, 1

    assert RunControl(lambda p: None).end([D()]) == RunState.DONE
    assert RunControl(lambda p: None).end([D()], money_limited=True) == RunState.LIMITED
    assert RunState.LIMITED in INCOMPLETE
