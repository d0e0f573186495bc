"""What the operator reads outside the panels: the history and its file, the recent-error rings, how a
run ends (state, exit code, the summary in the shell), the headless lines and `draftgen report`."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import orjson
import pytest

from draftgen.cli.main import main
from draftgen.core.live import snapshot as snap
from draftgen.core.live.recent import ProviderStats, RecentErrors
from draftgen.core.live.summary import EXIT_INCOMPLETE, summary_lines
from draftgen.core.live.timeline import TimelineRecorder, Totals, read_history
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.headless.printer import WIDTH, detail_lines, status_line
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui.report import report
from tests import fixtures as fx
from tests.helpers import TEST_KEY, dataset_row, make_config

pytestmark = pytest.mark.usefixtures("utc")  # conftest.py: times render in UTC


class Clock:
    def __init__(self, t: float = fx.T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_history_is_bounded_and_spans_every_run(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    clock = Clock()
    first = TimelineRecorder(path, interval_s=5.0, capacity=40, clock=clock)
    first.start(Totals(0, 0, 0.0, 0, 0))
    for i in range(1, 201):  # 1,000 s of a run: 200 intervals
        clock.t += 5.0
        first.observe(Totals(answers=4 * i, tokens=20_000 * i, usd=0.03 * i, errors=i // 10, in_flight=500))
    first.close()
    tl = first.timeline()
    # Bounded: pairs merged as it filled, the start still there at a coarser resolution.
    assert len(tl.points) <= 40 and tl.interval_s == 40.0 and tl.points[0][0] == fx.T0
    assert tl.series("req_s")[-1] == pytest.approx(0.8) and tl.series("tok_s")[-1] == pytest.approx(4_000)
    assert tl.series("usd_min")[-1] == pytest.approx(0.36) and tl.series("in_flight")[-1] == 500
    lines = list(read_history(path))
    assert len(lines) == 200 and sum(iv.answers for iv in lines) == 800
    # A resumed run reads it back first: its history starts where the first began, both runs counted.
    path.open("ab").write(b'{"ts": 1, "torn')  # a crash mid-line is skipped, not fatal
    clock.t += 3_600
    second = TimelineRecorder(path, interval_s=5.0, capacity=40, clock=clock)
    second.load()
    second.start(Totals(0, 0, 0.0, 0, 0))
    assert len(second.timeline().runs) == 2 and second.first_started_at == fx.T0
    assert second.timeline().points[0][0] == fx.T0


def test_recent_errors_keep_each_kind_dataset_and_provider() -> None:
    stats = ProviderStats()
    recent = RecentErrors(per_key=3, providers=stats)
    recent.add(kind="timeout", dataset="B1", prompt_id="rare", attempt=1, message="once")
    for i in range(1_000):  # a storm of one kind does not push the rare one out
        recent.add(kind="429", dataset="B5", prompt_id=f"p{i}", attempt=1, message="x" * 500, provider="novita")
    records = recent.records()
    assert any(r.prompt_id == "rare" for r in records)
    assert len(records) <= 3 * 5 and max(len(r.message) for r in records) <= 300
    recent.mark_final("B5", "p999")
    assert [r.final for r in recent.records() if r.prompt_id == "p999"] == [True]
    stats.answer("novita", 2.0, 100)
    stats.answer("novita", 4.0, 300)
    (s,) = stats.stats()
    assert (s.answers, s.errors, s.latency_mean_s, s.completion_tokens) == (2, 1_000, 3.0, 400)


def test_headless_lines_fit_120_columns_with_wall_clock_and_both_totals() -> None:
    s = fx.running()
    line = status_line(s, now=fx.T0 + 2_368)
    assert len(line) <= WIDTH and line.startswith("10:39:28 RUNNING +0:39:28 | 8,288/83,012")
    assert "spent $65.85+$3.63 rsv/$130.00" in line and "460 in flight" in line
    # Left out of a full status line, the recent rates are in the detail lines; money has two decimals.
    assert any("30s: 3.62 req/s 19.2k tok/s" in x for x in [line, *detail_lines(s)])
    assert any("spent $65.85 (all runs, $65.85 this run) / reserved $3.63 / ceiling $130.00" in d
               for d in detail_lines(s))
    for d in detail_lines(fx.out_of_credits()):
        assert len(d) <= WIDTH
    assert any("ALERT: 402" in d for d in detail_lines(fx.out_of_credits()))
    block = summary_lines(fx.ended(snap.RunState.DRAINED), EXIT_INCOMPLETE, config_hint="kimi.toml")
    assert all(len(x) <= WIDTH for x in block)
    assert block[0].startswith("draftgen: run kimi-k25-eagle3: DRAINED")  # "run": a run dir named draftgen reads once
    assert "exit 3 (incomplete: run again to resume)" in block[-1]
    assert any("`draftgen run kimi.toml` again resumes them" in x for x in block)


def test_draftgen_alone_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("smoke", "run", "attach", "report", "tokens", "merge", "extract", "simulate", "demo"):
        assert f"\n    {command} " in out
    assert "3  incomplete" in out


async def test_a_drained_run_ends_drained_exits_3_and_leaves_its_history(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, fixed_latency_s=0.2, mean_completion_tokens=50),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False, "snapshot_hz": 20}})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        pipeline.timeline.base_interval_s = 0.2  # points quickly (the default is 5 s)
        pipeline.timeline.series.interval_s = 0.2
        await pipeline.start()
        try:
            work = asyncio.create_task(pipeline.generate())
            while dataset_row(pipeline.engine, "a").done < 20 or not pipeline.timeline.timeline().points:
                await asyncio.sleep(0.05)
            pipeline.quit(drain=True)
            state = await asyncio.wait_for(work, 60)
            final = pipeline.snapshot()
        finally:
            await pipeline.close()
    assert state == snap.RunState.DRAINED and pipeline.exit_code == EXIT_INCOMPLETE
    assert final.ended.startswith("DRAINED: ") and "not asked yet" in final.ended
    assert final.timeline.points and final.started_at > 0
    history = RunDir(cfg.run_dir).history
    assert history.exists() and orjson.loads(history.read_bytes().splitlines()[0])["dt"] > 0
    out = io.StringIO()
    report(cfg.run_dir, out=out, width=100)
    text = out.getvalue()
    assert "requests/s" in text and "requests in flight" in text and "total" in text
    assert any(block in text for block in "▁▂▃▄▅▆▇█")


async def test_errors_reach_the_snapshot_with_prompt_ids(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40, faults={"500": 0.3}),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False, "max_attempts": 2}})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            await asyncio.wait_for(pipeline.generate(), 60)
            s = pipeline.snapshot()
        finally:
            await pipeline.close()
    assert s.recent_errors and all(r.dataset == "a" and r.prompt_id.startswith("a-") for r in s.recent_errors)
    assert s.errors and sum(n for _, n in s.errors) >= len(s.recent_errors)
    if s.datasets[0].failed:  # a prompt that failed for good is marked so in its last record
        assert any(r.final and r.attempt == 2 for r in s.recent_errors)
    assert s.provider_stats and sum(p.answers for p in s.provider_stats) == s.datasets[0].done


def test_history_and_drill_down_data_reach_an_attached_viewer() -> None:
    s = fx.ended(snap.RunState.DRAINED)
    back = snap.snapshot_from_dict(orjson.loads(s.to_json()))
    assert back.timeline == s.timeline and back.recent_errors == s.recent_errors
    assert back.provider_stats == s.provider_stats and back.ended == s.ended and back.state == s.state
