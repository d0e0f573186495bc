"""The pipeline as the TUI and headless runner drive it: the smoke gate, live reconstruction, stages."""

from __future__ import annotations

import asyncio

import orjson

from draftgen.core.live import snapshot as snap
from draftgen.core.run.pipeline import Pipeline, smoke_status
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer

from .helpers import TEST_KEY, make_config, read_ids

TABLES = {"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"reconstruct": True, "workers": 1}}


async def generate(cfg, **kw):
    pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, **kw)
    await pipeline.start()
    try:
        state = await asyncio.wait_for(pipeline.generate(), 120)
    finally:
        await pipeline.close()
    return pipeline, state


async def test_run_without_a_smoke_test_runs_one_first(tmp_path):
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=80), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 8}], tables=TABLES)
        assert not smoke_status(cfg)[0]
        pipeline, state = await generate(cfg)
    assert state == snap.RunState.DONE and pipeline.exit_code == 0
    assert smoke_status(cfg) == (True, "")
    rd = RunDir(cfg.run_dir)
    answered = read_ids(rd.responses("a"))
    assert len(answered) == 30
    # Reconstruction ran as answers landed: one valid token entry per answer.
    reader = TokenReader(rd.tokens("a"))
    assert sorted(e.id for e in reader.entries) == sorted(answered)
    assert all(e.meta["valid"] for e in reader.entries)


async def test_failing_smoke_refuses_the_run(tmp_path):
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=80,
                                   misbehave=("ignore_routing",)), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 8}], tables=TABLES,
                          request={"include_reasoning": True, "provider": {"ignore": ["fireworks"]}})
        pipeline, state = await generate(cfg)
        requests = sim.stats.requests_total
    assert state == snap.RunState.STOPPED and pipeline.exit_code == 1
    assert "smoke test failed" in pipeline.snapshot().alert
    assert not RunDir(cfg.run_dir).responses("a").exists()
    assert requests == 1  # the smoke request only
    smoke = orjson.loads(RunDir(cfg.run_dir).smoke_json.read_bytes())
    assert not smoke["passed"]


async def test_skip_smoke_and_stage_availability(tmp_path):
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=80), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 10, "concurrency": 4}], tables=TABLES)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        await pipeline.start()
        assert "nothing to merge" in pipeline.unavailable("merge")
        assert "[extract] model" in pipeline.unavailable("extract")
        assert "nothing to resume" in pipeline.unavailable("resume")
        assert await pipeline.generate() == snap.RunState.DONE
        assert not RunDir(cfg.run_dir).smoke_json.exists()
        assert pipeline.unavailable("merge") is None
        pipeline.start_merge()
        await asyncio.wait_for(pipeline.oneshot.task("merge"), 60)
        assert pipeline.snapshot().stage("merge").state == "done"
        await pipeline.close()
    assert len((RunDir(cfg.run_dir).merged / "train.jsonl").read_bytes().splitlines()) == 10


async def test_missing_tokenizer_stops_with_a_clear_alert(tmp_path):
    async with SimServer(SimConfig(seed=2, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5}],
                          tables={"tokenizer": {"path": str(tmp_path / "no-such-tokenizer")}})
        pipeline, state = await generate(cfg, skip_smoke=True)
    assert state == snap.RunState.STOPPED and pipeline.exit_code == 2
    assert "no-such-tokenizer" in str(pipeline.error)
    assert "no-such-tokenizer" in pipeline.snapshot().alert
