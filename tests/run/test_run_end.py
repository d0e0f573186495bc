"""How a run ends tells the truth, through the real entry points (a headless run in a subprocess, the
TUI run in a pseudo-terminal): a stop on a full disk exits 3 with its closing summary, saying what could
not be written; answers an earlier run spooled are given token ids by the run that imports them, and
the summary counts every answer on disk; events.log never says a signal drains after the run ended.

The full disk is a real RLIMIT_FSIZE in the child process (tests/run/test_disk_faults.py `fsize_limit`),
lowered from outside with prlimit(2) once the run is paused on it.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import threading

import orjson
import pytest

from draftgen.core.generate.loop.spool import SpoolRecord, find_spools, write_spool
from draftgen.core.live.summary import signal_line
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests import fixtures as fx
from tests.helpers import TEST_KEY, cli_env, drain_pty, make_config, tui_run_in_pty, until
from tests.run.test_disk_faults import fsize_limit, parsed_ids
from tests.run.test_registry import run_done


async def test_the_run_that_imports_spooled_answers_gives_them_token_ids(tmp_path, monkeypatch):
    """An earlier run spooled 6 answers (the disk was full); the next run imports them before it sends
    anything, and reconstructs them with the rest: token ids for every answer on disk, and the summary's
    token count is the number of answers on disk."""
    spool_dir = tmp_path / "spool"
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(spool_dir))
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 4}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"workers": 1}})
        run = RunDir(cfg.run_dir)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False, reconstruct=False)
        await pipeline.start()
        try:
            await asyncio.wait_for(pipeline.generate(), 60)
        finally:
            await pipeline.close()
        # As the disk left it: the last 6 answers in a spool, not in responses.jsonl.
        lines = run.responses("a").read_bytes().splitlines(keepends=True)
        assert len(lines) == 20
        run.responses("a").write_bytes(b"".join(lines[:14]))
        path, _ = write_spool(run.root, [SpoolRecord("a", "responses", orjson.loads(line)) for line in lines[14:]])
        assert path is not None and [s.path for s in find_spools(run.root)] == [path]
        requests = sim.stats.requests_total
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "draftgen.cli.main", "run",
                                       str(cfg.path), "--headless", "--skip-smoke"],
                                       env=cli_env(DRAFTGEN_SPOOL_DIR=str(spool_dir)), capture_output=True,
                                       text=True, timeout=120)
        assert sim.stats.requests_total == requests, "the imported answers were not asked again"
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    on_disk = parsed_ids(run.responses("a"))
    assert len(on_disk) == 20 and not path.exists()
    assert sorted(e.id for e in TokenReader(run.tokens("a")).entries) == sorted(on_disk)
    assert "tokens: 20 of 20 answers" in out, out[-3000:]


@pytest.mark.slow
async def test_a_signal_after_the_drain_began_is_not_logged_as_a_new_drain(tmp_path):
    """The TUI run in a pty gets SIGHUP twice (a closed pane, a shell passing it on): events.log says
    the first drains and the second finds the drain under way, both before the run's end line; nothing
    after "run DRAINED" says it is draining."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.4, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        proc, master = tui_run_in_pty(cfg.path)
        stop = threading.Event()
        reader = asyncio.ensure_future(asyncio.to_thread(drain_pty, master, stop))
        try:
            await until(lambda: len(parsed_ids(run.responses("a"))) >= 4, "answers land", timeout=60)
            proc.send_signal(signal.SIGHUP)
            await until(lambda: run.events_log.exists() and b"SIGHUP" in run.events_log.read_bytes(),
                        "the first SIGHUP is logged")
            proc.send_signal(signal.SIGHUP)
            code = await asyncio.wait_for(asyncio.to_thread(proc.wait), 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            stop.set()
            await reader
            os.close(master)
    log = run.events_log.read_text().splitlines()
    assert code == 3, (code, log[-20:])
    end = next(i for i, line in enumerate(log) if "run DRAINED:" in line)
    signals = [line for line in log if "SIGHUP" in line]
    assert len(signals) == 2 and "SIGHUP: draining" in signals[0] and "already draining" in signals[1], signals
    assert all(log.index(line) < end for line in signals), log[end - 3:]
    assert not [line for line in log[end:] if "draining" in line], log[end:]


async def test_stop_now_on_a_full_disk_exits_3_with_the_summary_saying_what_was_not_written(tmp_path):
    async with SimServer(SimConfig(seed=6, fixed_latency_s=0.02, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 8}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"workers": 1}})
        run = RunDir(cfg.run_dir)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(DRAFTGEN_SPOOL_DIR=str(tmp_path / "spool")),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=fsize_limit(40_000))
        out: list[str] = []
        try:
            assert proc.stdout is not None
            while not any("ALERT" in line for line in out):
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert line, "the run ended without pausing: " + "".join(out)[-3000:]
                out.append(line)
            # Now nothing more fits anywhere: every file, the tokens report and the spool included.
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGINT)  # stop now
            rest, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = "".join(out) + rest.decode()
    stderr = err.decode()
    assert "Traceback" not in text + stderr, (text + stderr)[-3000:]
    assert not stderr.startswith("draftgen: error"), stderr[-2000:]
    assert proc.returncode == 3, (proc.returncode, text[-3000:], stderr[-2000:])
    summary = text[text.rindex("draftgen: "):]
    joined = " ".join(x.strip() for x in summary.splitlines())
    assert "exit 3 (incomplete" in joined, summary
    assert f"cannot write {run.tokens('a') / 'report.json'}" in joined, summary
    assert f"draftgen tokens {cfg.path}" in joined, summary


def test_a_drain_signal_after_the_run_ended_is_not_said_to_drain() -> None:
    assert signal_line("SIGHUP", fx.ended("DRAINED"), again=False) == \
        "SIGHUP: the run has already ended (DRAINED); closing"
    assert signal_line("SIGTERM", fx.running(), again=False).startswith("SIGTERM: draining (generation is running")
    assert signal_line("SIGHUP", fx.running(), again=True) == "SIGHUP: already draining; the drain goes on"
    assert "merge is running" in signal_line("SIGTERM", fx.merging(), again=False)


async def test_the_summary_says_how_many_paid_answers_were_cut_at_max_tokens_and_failed_their_checks(tmp_path):
    """A max_tokens below the answers' length: the run is DONE (every answer kept) but most were cut, their ids
    fail ends_with_eot and the merge leaves them out; the exit summary says so rather than '30 of 30 answers'."""
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=300), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4, "max_tokens": 24}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, (text[-3000:], err.decode()[-2000:])
    cut = sum(orjson.loads(line)["truncated"] for line in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines())
    assert cut >= 6, cut  # answers of ~300 tokens against a cap of 24: most are cut
    # Said during the run, once, as soon as 10 answers are in and most of them cut: a drain still saves money.
    joined = " ".join(x.strip() for x in text.splitlines())  # the headless log wraps its long lines
    assert joined.count("answers this run were cut at max_tokens: they are paid for and kept (marked truncated), "
                        "but the merge leaves them out; drain (q then d; headless: Ctrl-C)") == 1, text[-3000:]
    assert any(" warn " in x and "a: " in x and " of its " in x for x in text.splitlines()), text[-3000:]
    summary = " ".join(x.strip() for x in text[text.rindex("draftgen: run "):].splitlines())
    assert f"tokens: 12 of 12 answers, {12 - cut} valid (each dataset's tokens/report.json says which check " \
           "failed)" in summary, summary
    assert (f"answers kept but flagged this run (merge leaves out the cut and empty ones): {cut} cut at max_tokens "
            "(raise the dataset's max_tokens if they are many)") in summary, summary


async def test_the_header_says_what_the_exit_code_says_when_stages_after_the_run_failed_or_stopped(tmp_path):
    """One owner decides the end (core/run/life.py RunLife, with its weighed): after a DONE run, a
    failed merge and a stopped extraction are exit 2 and the header says FAILED (it said STOPPED); a
    smoke test stopped by hand is not the run's work: exit 0 and DONE (the header said STOPPED)."""
    async with run_done(tmp_path) as pipeline:
        pipeline.stages.start("smoke")
        pipeline.stages.stop("smoke", "stopped before it finished")
        smoke_stopped = (pipeline.snapshot().label, pipeline.exit_code)
        pipeline.stages.fail("merge", "merge failed: the disk is full")
        pipeline.stages.start("extract")
        pipeline.stages.stop("extract", "stopped at 2 of 4 files")
        both = (pipeline.snapshot().label, pipeline.exit_code)
    assert smoke_stopped == ("DONE", 0)
    assert both == ("FAILED", 2)
