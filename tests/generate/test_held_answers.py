"""Answers the disk refused (held in memory by the ledger) are paid for and never thrown away when the
run is quit: written once the disk takes them, or spooled (core/generate/loop/spool.py) and imported by the
next run, which does not ask those prompts again. And the TUI run drains on SIGHUP (a closed pane).

The full disk is the same stand-in as tests/run/test_disk_faults.py: os.write on the run's .jsonl files
fails (in process), or a real RLIMIT_FSIZE in a child process, lifted with prlimit(2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from draftgen.core.generate.loop.spool import SpoolRecord, find_spools, write_spool
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Event
from draftgen.core.live.summary import summary_lines
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui.screens.quitdialog import QuitScreen
from tests import fixtures as fx
from tests.helpers import TEST_KEY, cli_env, dataset_row, drain_pty, make_config, text, tui_run_in_pty, until
from tests.run.test_disk_faults import FullDisk, fsize_limit, parsed_ids
from tests.tui.test_tui import make


def events_of(sub) -> list[Event]:  # noqa: ANN001 - a hub Subscription
    out = []
    while (item := sub.get_nowait()) is not None:
        if item[0] == "event":
            out.append(item[1])
    return out


async def test_quit_with_held_answers_spools_them_and_the_next_run_imports_them(tmp_path, monkeypatch):
    """Paused on a full disk with answers held, quit (drain): the run waits for the disk; spool now:
    they go whole to DRAFTGEN_SPOOL_DIR, the summary names the file; the next run imports them (an id
    already on disk is not written twice), removes the spool, and never asks those prompts again."""
    spool_dir = tmp_path / "spool"
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(spool_dir))
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 80, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        disk = FullDisk(run.root, errno.EROFS, spare=run.spend.name)  # the spend ledger's lines go through
        monkeypatch.setattr(os, "write", disk)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        try:
            await until(lambda: dataset_row(pipeline.engine, "a").done >= 20, "20 answers")
            disk.full = True
            await until(lambda: pipeline.engine.state == snap.RunState.PAUSED and pipeline.engine.in_flight == 0,
                        "paused on the read-only disk, nothing in flight")
            held = pipeline.engine.book.held_answers
            assert held >= 1 and pipeline.snapshot().held_answers == held
            pipeline.quit(drain=True)
            await until(lambda: "waiting for the disk" in pipeline.engine.waiting(), "the drain waits for the disk")
            await asyncio.sleep(0.2)
            assert not task.done(), "a drain with answers held does not end the run"
            pipeline.spool_held()
            await asyncio.wait_for(task, 30)
            final = pipeline.snapshot()
        finally:
            await pipeline.close()
        events = events_of(sub)
        saved = parsed_ids(run.responses("a"))
        spools = sorted(spool_dir.glob("*.jsonl"))
        assert len(spools) == 1 and spools[0].name.startswith(run.root.name + "-"), spools
        spooled = [orjson.loads(line) for line in spools[0].read_bytes().splitlines()[1:]]
        spooled_ids = [r["record"]["id"] for r in spooled]
        assert len(spooled_ids) == held and not set(spooled_ids) & set(saved)
        assert all(r["record"]["content"] for r in spooled), "the records are spooled whole"
        assert any(e.kind == "spooled" and str(spools[0]) in e.message for e in events)
        assert not any(e.kind == "unsaved" for e in events)
        assert str(spools[0]) in final.held and f"{held} held answer(s) spooled" in final.held
        summary = " ".join(line.strip() for line in summary_lines(final, 3))
        assert f"spooled to {spools[0]}" in summary, summary
        assert "held in memory" not in summary and not final.alert, "nothing is held any more"
        answered = len(saved) + held
        assert dataset_row(pipeline.engine, "a").done == answered
        assert pipeline.exit_code == 3, "spooled answers wait for the next run: incomplete"

        # As if an import wrote one record and crashed before removing the spool: it is not written twice.
        disk.full = False
        with open(run.responses("a"), "ab") as f:
            f.write(orjson.dumps(spooled[0]["record"]) + b"\n")
        requests = sim.stats.requests_total
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 60) == snap.RunState.DONE
        finally:
            await pipeline.close()
        asked = sim.stats.requests_total - requests
    assert asked == 80 - answered, "the next run asked only the prompts neither saved nor spooled"
    final_ids = parsed_ids(run.responses("a")) + parsed_ids(run.failures("a"))
    assert sorted(final_ids) == sorted(f"a-{i}" for i in range(80)), "every prompt once"
    assert not list(spool_dir.glob("*.jsonl")), "the spool is removed once imported"
    assert any(e.kind == "spool" and "imported" in e.message for e in events_of(sub))


async def test_a_spool_that_cannot_be_imported_stays_and_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(tmp_path / "spool"))
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}})
        path, _ = write_spool(cfg.run_dir, [SpoolRecord("gone", "responses", {"id": "gone-1", "content": "x"})])
        assert path is not None and [s.path for s in find_spools(cfg.run_dir)] == [path]
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 60) == snap.RunState.DONE
        finally:
            await pipeline.close()
    assert path.exists()
    assert any(e.kind == "spool" and str(path) in e.message and "not imported" in e.message for e in events_of(sub))


def test_spool_falls_back_when_a_place_refuses(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(blocker / "spool"))  # under a file: mkdir fails
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    path, refused = write_spool(tmp_path / "run", [SpoolRecord("a", "responses", {"id": "a-1"})])
    assert path is not None and path.parent == tmp_path / "tmp" / "draftgen-spool"
    assert len(refused) == 1 and str(blocker / "spool") in refused[0]


# ---------------------------------------------------------------------------------------------
# Headless, in a child process with a real file-size limit


async def _headless_until_held(cfg, run: RunDir, spool_dir: Path) -> tuple[asyncio.subprocess.Process, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
        "--interval", "0.2", env=cli_env(DRAFTGEN_SPOOL_DIR=str(spool_dir)), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, preexec_fn=fsize_limit(30_000))
    out: list[str] = []
    assert proc.stdout is not None
    while not any("ALERT" in line for line in out):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line, "the run ended without pausing: " + "".join(out)[-3000:]
        out.append(line)
    await asyncio.sleep(0.3)  # requests in flight land (and are held)
    return proc, out


async def _read_until(proc: asyncio.subprocess.Process, out: list[str], needle: str) -> None:
    assert proc.stdout is not None
    while needle not in " ".join(x.strip() for x in out[-6:]):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line, f"ended before {needle!r}: " + "".join(out)[-3000:]
        out.append(line)


@pytest.mark.slow
async def test_headless_sigterm_with_held_answers_waits_for_the_disk_then_writes_them(tmp_path):
    async with SimServer(SimConfig(seed=7, fixed_latency_s=0.02, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 120, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        proc, out = await _headless_until_held(cfg, run, tmp_path / "spool")
        try:
            proc.send_signal(signal.SIGTERM)
            await _read_until(proc, out, "waits for the disk")
            await asyncio.sleep(0.5)
            assert proc.returncode is None, "the run waits while answers are held"
            held_before = len(parsed_ids(run.responses("a")))
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            rest, _ = await asyncio.wait_for(proc.communicate(), 60)  # the retry (every few s) writes them
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text_out = "".join(out) + rest.decode()
        assert "Traceback" not in text_out and "not saved" not in text_out, text_out[-3000:]
        assert "written once the disk took them" in text_out, text_out[-3000:]
        summary = " ".join(x.strip() for x in text_out[text_out.rindex("draftgen: "):].splitlines())
        assert "held in memory" not in summary, "the summary says answers are held after they were written"
        assert proc.returncode == 3, text_out[-2000:]  # drained with prompts left
        saved = parsed_ids(run.responses("a")) + parsed_ids(run.failures("a"))
        assert len(saved) > held_before and len(saved) == len(set(saved))
        requests = sim.stats.requests_total
        proc2 = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "draftgen.cli.main", "run",
                                        str(cfg.path), "--headless", "--skip-smoke"], env=cli_env(),
                                        capture_output=True, text=True, timeout=60)
        assert proc2.returncode == 0, (proc2.stdout + proc2.stderr)[-3000:]
        assert sim.stats.requests_total - requests == 120 - len(saved), "held answers were not asked again"
    assert sorted(parsed_ids(run.responses("a")) + parsed_ids(run.failures("a"))) == sorted(
        f"a-{i}" for i in range(120))


@pytest.mark.slow
async def test_headless_second_sigint_spools_the_held_answers(tmp_path):
    spool_dir = tmp_path / "spool"
    async with SimServer(SimConfig(seed=7, fixed_latency_s=0.02, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 120, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        proc, out = await _headless_until_held(cfg, run, spool_dir)
        try:
            proc.send_signal(signal.SIGINT)
            await _read_until(proc, out, "waits for the disk")
            proc.send_signal(signal.SIGINT)
            rest, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text_out = "".join(out) + rest.decode()
        spools = list(spool_dir.glob("*.jsonl"))
        assert len(spools) == 1, text_out[-3000:]
        joined = " ".join(x.strip() for x in text_out.splitlines())
        assert f"spooled to {spools[0]}" in joined and "not saved" not in joined, text_out[-3000:]
        summary = joined[joined.rindex("draftgen: "):]
        assert "held in memory" not in summary, "the summary says answers are held after they were spooled"
        assert proc.returncode == 3, text_out[-2000:]
        spooled = len(spools[0].read_bytes().splitlines()) - 1
        saved = len(parsed_ids(run.responses("a")) + parsed_ids(run.failures("a")))
        requests = sim.stats.requests_total
        proc2 = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "draftgen.cli.main", "run",
                                        str(cfg.path), "--headless", "--skip-smoke"],
                                        env=cli_env(DRAFTGEN_SPOOL_DIR=str(spool_dir)), capture_output=True,
                                        text=True, timeout=60)
        assert proc2.returncode == 0, (proc2.stdout + proc2.stderr)[-3000:]
        assert sim.stats.requests_total - requests == 120 - saved - spooled
    assert not spools[0].exists()
    assert sorted(parsed_ids(run.responses("a")) + parsed_ids(run.failures("a"))) == sorted(
        f"a-{i}" for i in range(120))


# ---------------------------------------------------------------------------------------------
# The TUI


async def test_the_quit_dialog_says_how_many_answers_are_held_and_offers_wait_or_spool() -> None:
    app, controls = make(dataclasses.replace(fx.paused(), held_answers=50, alert="cannot write x: the disk is full"))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        body = " ".join(text(app, "#quit-text").split())
        assert "50 paid answers are held in memory, not on disk" in body, body
        assert "wait" in body and "spool now" in body and "every answer already on disk is kept" not in body
        await pilot.press("s")  # stop now while held: spooled, not dropped
        assert controls.calls == ["quit:drain", "spool"]
    app, controls = make(dataclasses.replace(fx.paused(), held_answers=50))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("q", "w")
        assert controls.calls == ["quit:drain"] and app.is_running  # waits for the disk, screen up


# ---------------------------------------------------------------------------------------------
# SIGHUP to the TUI run under a pseudo-terminal


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGHUP", "SIGTERM"])
async def test_closing_the_pane_drains_the_tui_run(tmp_path, how):
    """The TUI run in a pty; the pty's master closes (a tmux pane closed): the kernel hangs the
    terminal up and sends SIGHUP. Or SIGTERM, the screen still there. The run drains, events.log gets
    the end event, exit code 3."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.4, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        proc, master = tui_run_in_pty(cfg.path)
        try:
            stop = threading.Event()
            reader = asyncio.ensure_future(asyncio.to_thread(drain_pty, master, stop))
            await until(lambda: len(parsed_ids(run.responses("a"))) >= 4, "answers land", timeout=60)
            if how == "SIGTERM":
                proc.send_signal(signal.SIGTERM)  # the reader goes on: the screen is still drawn
            else:
                stop.set()
                await reader  # no thread still reads the master, so closing it hangs the terminal up
                await asyncio.sleep(1.0)  # unread, the pty fills: Textual's writer blocks, as in a frozen pane
                os.close(master)  # the pane is gone: the blocked write fails (EIO)
            try:
                code = await asyncio.wait_for(asyncio.to_thread(proc.wait), 60)
            except TimeoutError:
                raise AssertionError("the run did not end: " + run.events_log.read_text()[-3000:]) from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if how == "SIGTERM":
                stop.set()
                await reader
                os.close(master)
        log = run.events_log.read_text()
        assert code == 3, (code, log[-2000:])
        assert f"{how}: draining" in log, log[-2000:]
        assert "run DRAINED:" in log, log[-2000:]
        assert "Traceback" not in log
        # The requests in flight finished and were recorded: nothing torn, every id once.
        ids = parsed_ids(run.responses("a"))
        assert len(ids) == len(set(ids)) and 4 <= len(ids) < 400

