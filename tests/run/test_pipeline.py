"""The pipeline as the TUI and headless runner drive it: the smoke gate, live reconstruction, stages."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from draftgen.core.live import snapshot as snap
from draftgen.core.run.pipeline import Pipeline, smoke_status
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config, read_ids

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


def test_a_stage_stopped_stays_stopped_when_its_worker_thread_reports_after(tmp_path):
    import threading

    from draftgen.core.run.stage_rows import StageRows
    rows = StageRows()
    rows.start("merge")
    report = rows.reporter("merge")

    def in_thread(progress: snap.StageProgress) -> None:
        t = threading.Thread(target=report, args=(progress,))
        t.start()
        t.join()

    in_thread(snap.StageProgress("merge", state=snap.StageState.RUNNING, done=3, total=10))
    assert rows.get("merge").done == 3, "a worker thread's report lands"
    rows.stop("merge", "stopped by the user")
    in_thread(snap.StageProgress("merge", state=snap.StageState.RUNNING, done=4, total=10))
    merge = rows.get("merge")
    assert merge.state == snap.StageState.STOPPED and merge.done == 3 and merge.message == "stopped by the user"
    rows.start("extract")
    rows.set(snap.StageProgress("tokens", state=snap.StageState.DONE))
    rows.fail_running("disk gone")
    assert [(r.name, r.state) for r in rows.rows()] == [
        ("tokens", snap.StageState.DONE), ("merge", snap.StageState.STOPPED), ("extract", snap.StageState.FAILED)]


@pytest.mark.parametrize("reconstruct", [False, True], ids=["no-tokens", "tokens"])
async def test_a_run_builds_one_redactor_and_one_run_directory_and_hands_them_on(tmp_path, monkeypatch, reconstruct):
    from draftgen.core import rundir, secrets
    built = {"redactor": 0, "rundir": 0}
    redactor_init, rundir_init = secrets.Redactor.__init__, rundir.RunDir.__init__

    def count_redactor(self, secret, *others):
        built["redactor"] += secret == TEST_KEY
        redactor_init(self, secret, *others)

    def count_rundir(self, root):
        built["rundir"] += 1
        rundir_init(self, root)

    monkeypatch.setattr(secrets.Redactor, "__init__", count_redactor)
    monkeypatch.setattr(rundir.RunDir, "__init__", count_rundir)
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "concurrency": 2}], tables=TABLES)
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, reconstruct=reconstruct)
        assert built == {"redactor": 1, "rundir": 1}, built
        await pipeline.start()
        try:  # the start-up check, the smoke test and the run: all with the run's own
            state = await asyncio.wait_for(pipeline.generate(), 120)
        finally:
            await pipeline.close()
    assert state == snap.RunState.DONE and pipeline.exit_code == 0, pipeline.snapshot().alert
    assert built == {"redactor": 1, "rundir": 1}, built


def test_the_snapshot_is_made_once_from_the_owners_views(tmp_path):
    from draftgen.core.generate.loop.projection import Beside
    cfg = make_config(tmp_path, "http://127.0.0.1:9", [{"name": "a", "n": 3}])
    pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False)
    alone = pipeline.engine.snapshot()
    assert alone.generation is None and alone.stages == () and alone.credits.spent_usd == 0.0
    stage = snap.StageProgress("merge", state=snap.StageState.RUNNING)
    s = pipeline.engine.snapshot(Beside(generation=snap.StageState.SKIPPED, stages=(stage,), started_at=12.0,
                                        first_started_at=3.0, smoke_spent=(1.0, 1.25)))
    assert s.generation == snap.StageState.SKIPPED and s.stages == (stage,) and s.seq == alone.seq + 1
    assert (s.started_at, s.first_started_at) == (12.0, 3.0)
    assert (s.credits.spent_usd, s.credits.spent_total_usd) == (0.25, 1.25), "the smoke test's spend, from the file"
    seen = pipeline.snapshot()
    assert seen.generation == snap.StageState.IDLE and seen.ended == "" and seen.held == ""
