"""The run's one owner (core/run/life.py `RunLife`): how generation ended (RunControl.end), the label every
view shows, `finished` and the exit code are decided once, carried in the snapshot, and read as they are by
the headless lines, the summary block, the quit dialog's words and an attached viewer (the JSON stream);
the tricky ends run for real against the simulator."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.errors import DraftgenError, ExitCode
from draftgen.core.generate.api.account import AccountStop
from draftgen.core.generate.api.classify import AccountCondition
from draftgen.core.generate.loop.run_state import RunControl
from draftgen.core.live import snapshot as snap
from draftgen.core.live.snapshot import RunState, StageState
from draftgen.core.live.summary import quit_effects, signal_line, summary_lines
from draftgen.core.run.life import RunLife, standing
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.run.stage_rows import StageRows
from draftgen.headless.printer import status_line
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until
from tests.run.test_registry import run_done

ROUTING = {"ignore": ["fireworks", "baseten"], "allow_fallbacks": True, "quantizations": ["int4"]}


def views(s: snap.RunSnapshot, code: int) -> dict[str, str]:
    """What each view says of the run's end, from the snapshot (the attached viewer's from its JSON)."""
    attached = snap.snapshot_from_dict(orjson.loads(s.to_json()))
    lines = summary_lines(s, code)
    return {"headless": status_line(s, now=0.0).split(" ")[1], "summary": lines[0], "exit": lines[-1],
            "attach": attached.label, "signal": signal_line("SIGHUP", s, again=False)}


def said(s: snap.RunSnapshot, code: int, label: str) -> None:
    """Every view says `label`, the owner's, and the summary the exit code the shell gets."""
    seen = views(s, code)
    assert seen["headless"] == seen["attach"] == label, seen
    assert f": {label} after " in seen["summary"] and seen["exit"].startswith(f"  exit {code} "), seen
    assert seen["signal"] == f"SIGHUP: the run has already ended ({label}); closing", seen


async def ended(tmp_path: Path, *, n: int = 200, latency_s: float = 0.1, then: Callable[[Pipeline, SimServer], Any],
                tables: dict[str, Any] | None = None) -> tuple[RunState, snap.RunSnapshot, int]:
    """A pipeline run against the simulator, `then` acting on it once 4 answers are on disk."""
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, fixed_latency_s=latency_s, mean_completion_tokens=40),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}, **(tables or {})})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            work = asyncio.create_task(pipeline.generate())
            await until(lambda: dataset_row(pipeline.engine, "a").done >= 4 or work.done(), "4 answers", timeout=60)
            await then(pipeline, sim)
            state = await asyncio.wait_for(work, 60)
            return state, pipeline.snapshot(), pipeline.exit_code
        finally:
            await pipeline.close()


async def test_a_drained_run_is_drained_everywhere_exit_3(tmp_path: Path) -> None:
    async def drain(pipeline: Pipeline, sim: SimServer) -> None:
        pipeline.quit(drain=True)

    state, s, code = await ended(tmp_path, then=drain)
    assert (state, s.state, s.label, s.finished, code) == (RunState.DRAINED, RunState.DRAINED, "DRAINED", True, 3)
    assert s.ended.startswith("DRAINED: ") and s.generation == StageState.STOPPED
    said(s, code, "DRAINED")


async def test_a_stopped_run_is_stopped_everywhere_exit_3(tmp_path: Path) -> None:
    async def stop(pipeline: Pipeline, sim: SimServer) -> None:
        pipeline.quit(drain=False)

    state, s, code = await ended(tmp_path, then=stop)
    assert (state, s.label, s.finished, code) == (RunState.STOPPED, "STOPPED", True, 3)
    said(s, code, "STOPPED")


async def test_a_run_drained_while_the_account_held_it_ends_waiting_exit_3(tmp_path: Path) -> None:
    async def out_of_credits(pipeline: Pipeline, sim: SimServer) -> None:
        sim.scenario("out_of_credits")
        await until(lambda: pipeline.control.account is not None, "the run held by the account", timeout=60)
        pipeline.quit(drain=True)

    state, s, code = await ended(tmp_path, then=out_of_credits)
    assert (state, s.label, s.finished, code) == (RunState.WAITING, "WAITING", True, 3)
    said(s, code, "WAITING")


async def test_max_usd_skipping_a_prompt_ends_limited_exit_3(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=80), port=0) as sim:
        prompts = tmp_path / "prompts" / "a.jsonl"
        prompts.parent.mkdir(parents=True)
        rows = [{"id": f"q{i}", "prompt": f"Question {i}: explain item {i}."} for i in range(6)]
        rows.insert(2, {"id": "huge", "prompt": "word " * 40_000})  # its worst case alone is over max_usd
        prompts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        cfg = make_config(tmp_path, sim.base_url,
                          [{"name": "a", "prompts": "prompts/a.jsonl", "concurrency": 2, "max_tokens": 256}],
                          tables={"budget": {"max_usd": 0.05}, "engine": {"reconstruct": False}},
                          request={"temperature": 0.6, "provider": ROUTING})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            state = await asyncio.wait_for(pipeline.generate(), 60)
            s, code = pipeline.snapshot(), pipeline.exit_code
        finally:
            await pipeline.close()
    assert (state, s.label, s.finished, code) == (RunState.LIMITED, "LIMITED", True, 3)
    assert s.ended.startswith("LIMITED by max_usd: 6 of 7 answered") and s.generation == StageState.DONE, s.ended
    said(s, code, "LIMITED")


async def test_a_later_stage_failed_or_stopped_after_done_is_said_as_the_exit_code_says_it(tmp_path: Path) -> None:
    """Generation ended DONE: a stopped extraction makes the run STOPPED (3), a failed merge FAILED (2),
    in the snapshot every view reads; while extraction runs the label is EXTRACTING and the run is not
    finished (the quit dialog asks about extraction)."""
    async with run_done(tmp_path) as pipeline:
        done = pipeline.snapshot(), pipeline.exit_code
        pipeline.stages.start("extract")
        extracting = pipeline.snapshot()
        pipeline.stages.stop("extract", "stopped at 2 of 4 files")
        stopped = pipeline.snapshot(), pipeline.exit_code
        pipeline.stages.fail("merge", "merge failed: the disk is full")
        failed = pipeline.snapshot(), pipeline.exit_code
    assert (done[0].label, done[0].finished, done[1]) == ("DONE", True, 0)
    said(*done, "DONE")
    assert (extracting.label, extracting.finished) == ("EXTRACTING", False)
    assert quit_effects(extracting).stage == "extract"
    assert (stopped[0].state, stopped[0].label, stopped[1]) == (RunState.DONE, "STOPPED", 3)
    said(*stopped, "STOPPED")
    assert (failed[0].state, failed[0].label, failed[1]) == (RunState.DONE, "FAILED", 2)
    said(*failed, "FAILED")


def test_the_views_read_the_label_and_finished_carried_never_their_own_rule() -> None:
    """A snapshot whose carried label and `finished` differ from what its states would give: every view
    says the carried ones (none decides again)."""
    base = dataclasses.replace(snap.RunSnapshot("run", "m", state=RunState.DONE), label="MERGING", finished=False)
    assert standing(base.state, base.stage_state("generation"), base.stages).label == "DONE"
    assert status_line(base, now=0.0).split(" ")[1] == "MERGING"
    assert summary_lines(base, 0)[0].startswith("draftgen: run run: MERGING after ")
    assert signal_line("SIGTERM", base, again=False).startswith("SIGTERM: draining")
    assert snap.snapshot_from_dict(orjson.loads(base.to_json())).label == "MERGING"


def test_an_attached_viewer_reading_an_older_engines_snapshot_shows_its_state() -> None:
    """An older engine sends no `label` nor `finished`: the viewer shows its state as the label (what that
    engine's header showed), and does not take it as finished."""
    s = dataclasses.replace(snap.RunSnapshot("run", "m", state=RunState.DRAINED), label="DRAINED", finished=True)
    older = {k: v for k, v in orjson.loads(s.to_json()).items() if k not in ("label", "finished")}
    read = snap.snapshot_from_dict(older)
    assert (read.state, read.label, read.finished) == (RunState.DRAINED, "DRAINED", False)
    assert status_line(read, now=0.0).split(" ")[1] == "DRAINED"
    newer = snap.snapshot_from_dict({**older, "state": "PARKED"})  # a newer engine's state: shown as it is
    assert newer.label == "PARKED"


def life() -> RunLife:
    return RunLife(RunControl(lambda p: None), StageRows(), lambda text: text)


class Left:
    total, done, failed, skipped = 7, 5, 0, 0


class Answered:
    total, done, failed, skipped = 5, 5, 0, 0


async def test_the_exit_code_and_the_generation_stage_are_the_owners_from_what_it_was_told() -> None:
    """What the parts tell (launched, how generation ended, the tokens stage's report, a refused key, spooled
    answers, a failure, a quit before the start) gives the exit code and the generation stage's state."""
    done = life()
    assert (done.generation(), done.exit_code, done.launched) == (StageState.IDLE, ExitCode.COMPLETE, False)
    done.launch()
    done.control.start()
    assert done.generation() == StageState.RUNNING and not done.now().finished
    done.control.end([Answered()])
    done.ended(tokens_complete=True)
    assert (done.generation(), done.exit_code, done.now().label) == (StageState.DONE, ExitCode.COMPLETE, "DONE")
    done.rows.start("smoke")
    done.rows.stop("smoke", "stopped by hand")  # not the run's work
    assert (done.exit_code, done.now().label) == (ExitCode.COMPLETE, "DONE")
    done.rows.start("merge")
    assert (done.now().label, done.now().finished) == ("MERGING", False)
    done.rows.stop("merge", "stopped")
    assert (done.exit_code, done.now().label, done.now().finished) == (ExitCode.INCOMPLETE, "STOPPED", True)
    done.rows.fail("extract", "the disk is full")
    assert (done.exit_code, done.now().label) == (ExitCode.ERROR, "FAILED")

    spooled = life()  # records waiting in a spool for the next run: incomplete, even when DONE
    spooled.launch()
    spooled.control.held_spooled(2, 1, "/tmp/spool.jsonl")
    spooled.control.end([Answered()])
    spooled.ended(tokens_complete=False)
    assert spooled.exit_code == ExitCode.INCOMPLETE

    refused = life()  # a refused key is 4, whatever else held
    assert refused.control.refuse_key(AccountStop(AccountCondition.KEY_REFUSED, "401 key refused"))
    refused.launch()
    refused.control.drain()
    refused.control.end([Left()])
    refused.ended(tokens_complete=True)
    assert (refused.exit_code, refused.generation(), refused.now().label) == (
        ExitCode.KEY_REFUSED, StageState.STOPPED, "DRAINED")

    tokens = life()  # answers left without token ids: an error
    tokens.launch()
    tokens.control.end([Answered()])
    tokens.ended(tokens_complete=False)
    assert tokens.exit_code == ExitCode.ERROR

    quit_early = life()  # quit before the run started: 130, the stage skipped
    quit_early.not_started()
    assert (quit_early.exit_code, quit_early.generation(), quit_early.now().label) == (
        ExitCode.INTERRUPTED, StageState.SKIPPED, "STOPPED")

    failed = life()  # an error after the start fails the stage and the running stages; before it, skips it
    failed.launch()
    failed.rows.start("tokens")
    failed.fail(DraftgenError("disk gone"))
    assert (failed.generation(), failed.exit_code, failed.rows.get("tokens").state) == (
        StageState.FAILED, ExitCode.ERROR, StageState.FAILED)
    assert (failed.control.alert, failed.now().finished) == ("disk gone", True)
    smoke = life()
    smoke.smoke_failed("the smoke test failed")
    assert (smoke.generation(), smoke.exit_code, smoke.now().label) == (
        StageState.SKIPPED, ExitCode.SMOKE_FAILED, "STOPPED")


async def test_the_tui_summary_after_a_key_refused_at_the_start_says_the_exit_code_the_shell_gets(tmp_path: Path):
    """The summary printed once the screen is gone reads the owner's exit code: 4 for a key refused at the
    start, as `draftgen run` exits (it said exit 2)."""
    import io

    from draftgen.core.errors import KeyRefusedError
    from draftgen.tui.app import DraftgenApp
    from draftgen.tui.launch import run_tui

    async with SimServer(SimConfig(seed=3, latency_scale=0.0, api_key="the-right-key"), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 4, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}})

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                await until(lambda: app.latest is not None and app.latest.finished, "the run stopped", timeout=60)
                await pilot.press("q")  # nothing runs: the app closes
                await until(lambda: not app.is_running, "the app exited", timeout=60)

        out = io.StringIO()
        with pytest.raises(KeyRefusedError) as caught:  # printed by cli/main.py, which exits with its code
            await asyncio.wait_for(run_tui(cfg, TEST_KEY, out=out, run_app=drive, skip_smoke=True), 120)
    assert caught.value.exit_code == ExitCode.KEY_REFUSED
    assert "  exit 4 (the API key was refused: set a valid one, run again)" in out.getvalue(), out.getvalue()
