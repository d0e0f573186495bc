"""An operator pauses a headless run from outside: SIGUSR2 pauses (the TUI's `p`), SIGUSR1 resumes. A real
`draftgen run --headless` subprocess against the simulator on loopback, real signals."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import orjson
import pytest

from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests import helpers
from tests.helpers import cli_env, make_config, until


@pytest.mark.slow
async def test_sigusr2_pauses_a_headless_run_and_sigusr1_resumes_it(tmp_path: Path) -> None:
    """SIGUSR2 mid-run: the run says it paused, the requests in flight finish, then the simulator receives
    nothing (the 429s' retries included) while the status lines say PAUSED; SIGUSR1 resumes and every prompt
    is answered once, exit 0. Before, SIGUSR2 killed the process (its default action): a headless run could
    not be paused at all."""
    n = 300
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.3, mean_completion_tokens=40,
                                   faults={"429": 0.2}, retry_after_s=0.2), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        lines: list[str] = []

        async def read_until(needle: str) -> None:
            await helpers.read_until(proc, lines, needle, timeout=120)

        try:
            await until(lambda: sim.stats.answers_total >= 20, "the run under way")
            proc.send_signal(signal.SIGUSR2)
            await read_until("SIGUSR2: paused")
            await until(lambda: sim.stats.in_flight == 0, "the requests sent before the pause answered")
            sent = sim.stats.requests_total
            del lines[:]
            for _ in range(3):  # three status lines of a paused run, nothing sent meanwhile
                await read_until("PAUSED")
                del lines[:]
            assert sim.stats.requests_total == sent
            answered_paused = sim.stats.answers_total
            assert answered_paused < n
            proc.send_signal(signal.SIGUSR1)
            rest, _ = await asyncio.wait_for(proc.communicate(), 120)  # a hang guard
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, rest.decode()[-3000:]
    ids = [orjson.loads(x)["id"] for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert len(ids) == len(set(ids)) == n
