"""The one registry of stages (core/run/registry.py): the pipeline, the stages panel's rows, the TUI's
keys and help, and the headless printer read it, so a stage added there runs with no other change."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftgen.cli.main import build_parser
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Level
from draftgen.core.live.stage_payloads import RunDone
from draftgen.core.run import registry
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.run.stage import RunStage, StageHost, When
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.headless.printer import MILESTONES, run_headless
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui.app import DraftgenApp
from draftgen.tui.screens.help import KEYS
from tests.helpers import TEST_KEY, make_config


def test_the_registry_is_the_run_order_every_view_names() -> None:
    assert tuple(s.name for s in registry.REGISTRY) == snap.STAGE_NAMES
    assert [s.label for s in registry.REGISTRY if s.name != "generation"] == [
        "SMOKE TEST", "TOKENS", "MERGING", "EXTRACTING"]
    # The TUI binds each stage's key, the help says what it does, headless prints each stage's outcome.
    bound = {b.key: b.description for b in DraftgenApp.BINDINGS if isinstance(b.key, str)}
    assert {s.key: s.name for s in registry.keyed()} == {"s": "smoke", "m": "merge", "x": "extract"}
    assert all(bound[str(s.key)] == s.name and (s.key, s.help) in KEYS for s in registry.keyed())
    assert set(registry.milestones()) <= set(MILESTONES)
    assert [s.flag for s in registry.chained()] == ["merge", "extract"]
    run = build_parser().parse_args(["run", "kimi.toml", "--headless", "--extract"])
    assert (run.merge, run.extract) == (False, True)  # `draftgen run --<flag>`: one per chained stage
    assert registry.stage("merge").steps == ("contamination",)


@dataclass(frozen=True, kw_only=True)
class _Counted(RunDone):
    """The count stage's outcome: a stage's own payload, under a kind headless prints."""
    answers: int

    def said(self) -> str:
        return f"count: {self.answers} answers on disk"


class _Count(RunStage):
    """A stage no module outside this test names: counts the answers on disk after generation."""
    name = "count"
    when = When.AFTER
    flag = "count"

    def unavailable(self, host: StageHost) -> str | None:
        if not any(host.rundir.responses(d.name).exists() for d in host.config.datasets):
            return "nothing to count yet"
        return None

    async def _count(self, host: StageHost) -> int:
        host.stages.start(self.name)
        lines = sum(len(host.rundir.responses(d.name).read_bytes().splitlines()) for d in host.config.datasets)
        (host.rundir.root / "count.txt").write_text(f"{lines}\n")
        host.stages.set(snap.StageProgress(self.name, state=snap.StageState.DONE, done=lines, total=lines))
        host.emit(_Counted(answers=lines, at=Level.WARN))
        return lines

    def run(self, host: StageHost, **options: Any) -> Any:
        return self._count(host)


async def test_a_stage_added_to_the_registry_runs_chained_after_generation_with_no_other_change(
        tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, _Count()))
    monkeypatch.setattr(snap, "STAGE_NAMES", (*snap.STAGE_NAMES, "count"))
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 6, "concurrency": 3}])
        before = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        assert before.unavailable("count") == "nothing to count yet"
        out = io.StringIO()
        code = await asyncio.wait_for(run_headless(cfg, TEST_KEY, skip_smoke=True, interval_s=0.05, out=out,
                                                   reconstruct=False, then={"count": True}), 120)
    assert code == 0, out.getvalue()
    assert (cfg.run_dir / "count.txt").read_text() == "6\n"
    assert "count: 6 answers on disk" in out.getvalue()
    assert before.unavailable("count") is None


@contextlib.asynccontextmanager
async def run_done(tmp_path: Path, answers: int = 4) -> AsyncIterator[Pipeline]:
    """A pipeline whose generation ended DONE with `answers` answers and their token ids, against the
    simulator; closed on the way out."""
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": answers, "concurrency": 2}], tables={
            "tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"reconstruct": True, "workers": 1}})
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 120) == snap.RunState.DONE
            yield pipeline
        finally:
            await pipeline.close()


async def test_a_stage_started_by_name_reports_its_row_in_run_order(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, _Count()))
    monkeypatch.setattr(snap, "STAGE_NAMES", (*snap.STAGE_NAMES, "count"))
    async with run_done(tmp_path) as pipeline:
        pipeline.start_merge()
        await asyncio.wait_for(pipeline.oneshot.task("merge"), 60)
        pipeline.start_stage("count")
        await asyncio.wait_for(pipeline.oneshot.task("count"), 60)
        rows = pipeline.snapshot().stages
    assert [(r.name, r.state, r.done) for r in rows] == [
        ("tokens", "done", 4), ("merge", "done", 4), ("count", "done", 4)]
