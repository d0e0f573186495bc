"""One liveness rule (core/files.py `exclusive`): a run directory is live while a process holds its
run lock, whatever became of the attach socket; and a run whose reconstruction workers die notices,
replaces them and still exits by itself. Real subprocesses, real signals, the simulator on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from draftgen.core.config_load import load_config
from draftgen.core.files import RunDirBusyError, exclusive
from draftgen.core.generate.commands.retry_failed import history_path, retry_failed
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.command import tokens_command
from draftgen.core.tokens.during_run import RunReconstructor
from draftgen.core.tokens.store import TokenReader
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config, until
from tests.run.test_soak import _start, soak
from tests.tokens.test_tokens import make_config as tokens_config
from tests.tokens.test_tokens import response, write_responses


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().splitlines() if line.strip()) if path.exists() else 0


async def _cli(config_path: Path, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", *args, str(config_path),
        env={**os.environ, soak.KEY_ENV: soak.SOAK_KEY}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def _workers(run_pid: int) -> list[psutil.Process]:
    """The reconstruction workers of a run: the children of its forkserver."""
    out = []
    for child in psutil.Process(run_pid).children():
        try:
            if any("forkserver" in part for part in child.cmdline()):
                out += child.children()
        except psutil.Error:
            continue
    return out


# -- the run lock ------------------------------------------------------------------------------------


async def test_a_started_pipeline_holds_the_run_lock_and_lets_go_when_closed(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        config = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}])
        pipeline = Pipeline(config, TEST_KEY, serve_attach=False)
        await pipeline.start()
        try:
            for refused in (lambda: retry_failed(config), lambda: tokens_command(config)):
                with pytest.raises(RunDirBusyError, match="a run is already live in this run directory") as caught:
                    refused()
                assert str(config.run_dir) in str(caught.value) and f"process {os.getpid()}: draftgen run" \
                    in str(caught.value)
            with pytest.raises(RunDirBusyError, match="draftgen run cannot work beside it"):
                await Pipeline(config, TEST_KEY, serve_attach=False).start()  # a second run
        finally:
            await pipeline.close()
        with exclusive(config.run_dir, "test"):  # released
            pass
        assert retry_failed(config)[0].moved == {}


@pytest.mark.slow
async def test_retry_failed_is_refused_beside_a_live_run_whose_attach_socket_is_gone(tmp_path: Path) -> None:
    """The socket deleted under a live run: retry-failed used to take that for no run, rename a new
    failures.jsonl over the one the run appends to, and the run's later failures went to the
    unlinked file. Now the run lock refuses it; after the run it works."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.2, mean_completion_tokens=40,
                                   scenarios={"moderation": {"rate": 0.2}}), port=0) as sim:
        path = soak.write_config(tmp_path, sim.base_url, prompts=600, concurrency=8, workers=1, max_attempts=1,
                                 budget=False)
        config = load_config(path)
        rd = RunDir(config.run_dir)
        failures = rd.failures("a")
        proc = await _start(path, asyncio.subprocess.DEVNULL)
        try:
            await until(lambda: _lines(failures) >= 5, "failures written by the live run", timeout=90)
            await until(rd.socket.exists, "the attach socket")
            inode = failures.stat().st_ino
            rd.socket.unlink()
            code, out = await _cli(path, "retry-failed")
            assert proc.returncode is None, "the live run ended before retry-failed came"
            assert code == 2 and "a run is already live" in out and str(rd.root) in out, out
            assert "draftgen retry-failed" in out and "Traceback" not in out, out
            assert failures.stat().st_ino == inode and not history_path(rd, "a").exists()
            sim.update(fixed_latency_s=0.0)
            assert await asyncio.wait_for(proc.wait(), 120) in (0, 3)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
            await soak.reap_session(proc.pid, 3.0)
        assert failures.stat().st_ino == inode  # every failure of the run is in the file it appended to
        disk = soak.read_disk(config)
        assert {len(disk.answered[d]) + len(disk.failed[d]) for d in ("a", "b")} == {400, 200}
        failed = _lines(failures)
        assert failed > 5
        code, out = await _cli(path, "retry-failed")
        assert code == 0 and f"{failed} failed prompt(s) eligible again" in out, out
        assert _lines(history_path(rd, "a")) == failed and _lines(failures) == 0


# -- dead reconstruction workers -------------------------------------------------------------------


async def _run_until_answering(tmp_path: Path, sim: SimServer) -> tuple[Path, asyncio.subprocess.Process, Path]:
    path = soak.write_config(tmp_path, sim.base_url, prompts=600, concurrency=8, workers=2, max_attempts=4,
                             budget=False)
    log = tmp_path / "run.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        proc = await _start(path, fd)
    finally:
        os.close(fd)
    await until(lambda: sim.stats.answers_total >= 60, "answers", timeout=90)
    await until(lambda: len(_workers(proc.pid)) == 2, "two reconstruction workers", timeout=30)
    return path, proc, log


def _tokens_complete(path: Path) -> bool:
    config = load_config(path)
    disk = soak.read_disk(config)
    rd = RunDir(config.run_dir)
    return all(sorted(e.id for e in TokenReader(rd.tokens(d.name)).entries) == sorted(disk.answered[d.name])
               for d in config.datasets)


@pytest.mark.slow
async def test_a_killed_reconstruction_worker_is_replaced_and_the_run_ends_by_itself(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.1, mean_completion_tokens=60), port=0) as sim:
        path, proc, log = await _run_until_answering(tmp_path, sim)
        try:
            os.kill(_workers(proc.pid)[0].pid, signal.SIGKILL)
            served = sim.stats.answers_total
            await until(lambda: sim.stats.answers_total >= served + 60, "answers after the kill", timeout=90)
            sim.update(fixed_latency_s=0.0)
            code = await asyncio.wait_for(proc.wait(), 180)  # a guard against the hang, not a speed check
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
            left = await soak.reap_session(proc.pid, 5.0)
    out = " ".join(log.read_text(errors="replace").split())  # events are wrapped at 120 columns
    assert code == 0, out[-3000:]
    assert "reconstruction worker process died" in out and "starting new workers (1 of at most 3)" in out, out[-3000:]
    assert "tokens: 600 of 600 answers" in out and "finish with" not in out, out[-3000:]
    assert _tokens_complete(path) and left == 0


@pytest.mark.slow
async def test_sigterm_after_a_worker_died_still_ends_the_run(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.3, mean_completion_tokens=60), port=0) as sim:
        path, proc, log = await _run_until_answering(tmp_path, sim)
        try:
            os.kill(_workers(proc.pid)[1].pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 120)  # a guard against the hang, not a speed check
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
            left = await soak.reap_session(proc.pid, 5.0)
    out = " ".join(log.read_text(errors="replace").split())
    assert code == 3 and "SIGTERM: draining" in out, out[-3000:]
    assert "tokens: " in out and left == 0, out[-3000:]
    assert _tokens_complete(path), out[-3000:]


@pytest.mark.slow
async def test_workers_that_keep_dying_stop_reconstruction_loudly(tmp_path: Path) -> None:
    """Past MAX_RESTARTS new pools the tokens stage fails and says how to finish; nothing hangs."""
    config = tokens_config(tmp_path)
    events: list[tuple[str, str, str]] = []
    live = RunReconstructor(config, workers=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
    live.MAX_RESTARTS = 1
    await live.start()
    records = [response(i) for i in range(40)]
    write_responses(config, "A", records)
    me = psutil.Process()

    def kill_workers() -> int:
        pids = [p.pid for child in me.children() if any("forkserver" in c for c in child.cmdline())
                for p in child.children()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return len(pids)

    assert kill_workers() == 1
    for rec in records[:20]:
        live.submit("A", rec)
    await until(lambda: live.restarts == 1 and live._restart is None, "a new pool", timeout=60)
    await until(lambda: kill_workers() == 1, "the new worker killed", timeout=30)
    for rec in records[20:]:
        live.submit("A", rec)
    await asyncio.wait_for(live.close(), 60)
    p = live.progress()
    assert p.state == "failed" and p.done < p.total == 40, p
    assert "died 2 times" in p.message and f"draftgen tokens {config.path}" in p.message, p.message
    assert [e[1] for e in events] == ["tokens_worker_died", "tokens_failed"], events
