"""Crash and resume of the whole product: the short form of benchmarks/soak.py, and the signals a
long run over SSH meets (a closed terminal, Ctrl-C twice), each through a real headless subprocess
with live reconstruction on, against the simulator with faults."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

import pytest

from draftgen.core.config_load import load_config
from draftgen.core.live.summary import EXIT_INCOMPLETE
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.simulator import FAULT_KINDS, SimConfig, SimServer


def _load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("draftgen_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_crash_and_resume_soak(tmp_path: Path) -> None:
    options = soak.SoakOptions(kills=6, prompts=1000, concurrency=16, storm_s=0, running_window_s=2.0,
                               startup_share=0.2, sample=40, seed=3, final_timeout_s=150)
    report = await asyncio.wait_for(soak.soak(options, tmp_path), 280)
    print(report.table())
    assert report.problems == []
    assert report.kills >= 5
    assert report.lost == 0 and report.duplicates == 0 and report.orphans == 0
    drains = {s.how: s for s in report.steps if s.how in ("SIGTERM", "SIGHUP")}
    assert set(drains) == {"SIGTERM", "SIGHUP"}
    assert all(s.drained and s.tokens_in_step and s.unwritten == 0 for s in drains.values())
    assert all(report.faults.get(kind, 0) > 0 for kind in FAULT_KINDS), report.faults
    assert set(report.scenarios) == set(soak.DEFAULT_SCENARIOS), report.scenarios  # every row mixed in answered
    a = report.audit
    assert a.answered + a.failed + a.skipped == a.prompts == 1000
    # Failures are the prompts' own (the audit checks each kind): the moderated, too long, invalid ones.
    assert (a.answered and a.failed and a.token_entries == a.answered
            and a.sampled == 80 and not a.sample_mismatch)  # 40 per dataset
    assert a.recorded_usd <= a.billed_usd and a.billed_usd - a.recorded_usd == pytest.approx(a.served_unwritten_usd)


# ---------------------------------------------------------------------------------------------
# One run, one signal


async def _start(config_path: Path, stdout: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(config_path), "--headless", "--skip-smoke",
        "--interval", "0.2", env={**os.environ, soak.KEY_ENV: soak.SOAK_KEY}, stdout=stdout, stderr=stdout,
        start_new_session=True)


async def _answers(sim: SimServer, at_least: int) -> None:
    while sim.stats.answers_total < at_least:
        await asyncio.sleep(0.02)


async def _requests(sim: SimServer, at_least: int) -> None:
    while sim.stats.requests_total < at_least:
        await asyncio.sleep(0.02)


async def _logged(log: Path, text: str) -> None:
    while text not in log.read_text(errors="replace"):
        await asyncio.sleep(0.02)


def _tokens_in_step(config_path: Path) -> bool:
    config = load_config(config_path)
    disk = soak.read_disk(config)
    rd = RunDir(config.run_dir)
    return all(sorted(e.id for e in TokenReader(rd.tokens(d.name)).entries) == sorted(disk.answered[d.name])
               for d in config.datasets)


@pytest.mark.slow
async def test_closed_terminal_then_sighup_drains(tmp_path: Path) -> None:
    """A headless run in a tmux pane that is closed: its terminal is gone (every write fails), then
    the whole process group gets SIGHUP. It must drain and exit 0, not carry on ignoring the signal."""
    async with SimServer(SimConfig(seed=2, fixed_latency_s=0.3, mean_completion_tokens=60), port=0) as sim:
        path = soak.write_config(tmp_path, sim.base_url, prompts=3000, concurrency=16, workers=1, max_attempts=4,
                                 budget=False)
        r, w = os.pipe()
        proc = await _start(path, w)
        os.close(w)
        try:
            await asyncio.wait_for(_answers(sim, 20), 60)
            assert os.read(r, 4096)  # it was talking to its terminal
        finally:
            os.close(r)  # the terminal goes away: its writes now fail with EPIPE
        await asyncio.sleep(0.5)
        os.killpg(proc.pid, signal.SIGHUP)
        try:
            code = await asyncio.wait_for(proc.wait(), 30)
        finally:
            left = await soak.reap_session(proc.pid, 3.0)
        served = sim.stats.answers_total
    assert code == EXIT_INCOMPLETE  # drained with prompts left: run again to resume
    assert left == 0
    disk = soak.read_disk(load_config(path))
    assert disk.written() == served and not disk.torn and not disk.duplicates()
    assert disk.written() < 3000, "it drained, it did not run to the end"
    assert _tokens_in_step(path)


@pytest.mark.slow
async def test_ctrl_c_drains_then_second_ctrl_c_stops(tmp_path: Path) -> None:
    """Ctrl-C in the terminal signals the whole foreground group (the reconstruction workers too):
    the first drains, the second stops now; nothing written is lost and the tokens keep up."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.5, mean_completion_tokens=60), port=0) as sim:
        path = soak.write_config(tmp_path, sim.base_url, prompts=1200, concurrency=16, workers=1, max_attempts=4,
                                 budget=False)
        log = open(tmp_path / "run.log", "wb")
        proc = await _start(path, log.fileno())
        log.close()
        await asyncio.wait_for(_answers(sim, 40), 60)
        # From now on every request takes a minute, and a few are in flight before the first Ctrl-C:
        # the drain cannot end on its own before the second one, however loaded this machine is (with
        # a sleep between the two, a slow machine let the drain finish first and the second SIGINT hit
        # a process that was closing, or gone).
        sim.update(fixed_latency_s=60.0)
        slow_from = sim.stats.requests_total
        await asyncio.wait_for(_requests(sim, slow_from + 4), 60)
        os.killpg(proc.pid, signal.SIGINT)
        await asyncio.wait_for(_logged(tmp_path / "run.log", "SIGINT: draining"), 60)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            # Well under the minute the slow requests take: the second Ctrl-C did not wait for them.
            code = await asyncio.wait_for(proc.wait(), 40)
        finally:
            left = await soak.reap_session(proc.pid, 3.0)
        first = soak.read_disk(load_config(path))
        # The next run picks up where it stopped and finishes (quickly: no more latency).
        sim.update(fixed_latency_s=None, latency_scale=0.0)
        proc = await _start(path, asyncio.subprocess.DEVNULL)
        assert await asyncio.wait_for(proc.wait(), 120) == 0
        await soak.reap_session(proc.pid, 3.0)
    out = (tmp_path / "run.log").read_text()
    assert code == EXIT_INCOMPLETE, out[-2000:]  # stopped with prompts left
    assert "run STOPPED: " in out and "not asked yet" in out and "exit 3 (incomplete" in out
    assert "SIGINT: draining" in out and "SIGINT again: stopping now" in out
    assert left == 0
    assert not first.torn and not first.duplicates()
    final = soak.read_disk(load_config(path))
    assert first.ids() <= final.ids() and not final.duplicates()
    assert sum(len(v) for v in final.answered.values()) + sum(len(v) for v in final.failed.values()) == 1200
    assert _tokens_in_step(path)


@pytest.mark.slow
async def test_second_process_on_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    """Back on the box after a while, one runs `draftgen run` again, or `draftgen tokens` to look at
    the report, while the nohup'ed run is still live: both are refused with a message, and the live
    run's files come out whole (a second token writer used to interleave its samples and corrupt them)."""
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.2, mean_completion_tokens=60), port=0) as sim:
        path = soak.write_config(tmp_path, sim.base_url, prompts=900, concurrency=16, workers=1, max_attempts=4,
                                 budget=False)
        proc = await _start(path, asyncio.subprocess.DEVNULL)
        try:
            await asyncio.wait_for(_answers(sim, 30), 60)
            env = {**os.environ, soak.KEY_ENV: soak.SOAK_KEY}
            outcomes = []
            for command in ("run", "tokens"):
                extra = ("--headless", "--skip-smoke") if command == "run" else ()
                other = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "draftgen.cli.main", command, str(path), *extra, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                out, _ = await asyncio.wait_for(other.communicate(), 60)
                outcomes.append((other.returncode, out.decode(), proc.returncode))
            sim.update(fixed_latency_s=0.0)  # the rest quickly
            assert await asyncio.wait_for(proc.wait(), 120) == 0
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
            await soak.reap_session(proc.pid, 3.0)
        stats = sim.stats
    (run_code, run_out, live1), (tokens_code, tokens_out, live2) = outcomes
    assert live1 is None and live2 is None, "the live run ended before the second process came"
    assert run_code == 2 and "a run is already live" in run_out and "Traceback" not in run_out
    assert tokens_code == 2 and "a run is already live" in tokens_out and "draftgen tokens" in tokens_out
    assert "Traceback" not in tokens_out
    a = soak.audit(load_config(path), stats, sample=150)
    assert a.problems == [] and a.sampled == 300 and a.answered + a.failed == 900
