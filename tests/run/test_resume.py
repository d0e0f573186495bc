"""kill -9 at random moments, run again: nothing acknowledged lost, no id twice."""

from __future__ import annotations

import asyncio
import random
import signal
import sys

import orjson
import pytest

from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, cli_env, make_config, read_ids


async def start_run(cfg, *extra):
    env = cli_env()
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
        "--interval", "0.5", *extra, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


@pytest.mark.slow
async def test_sigkill_and_restart_keeps_every_acknowledged_answer(tmp_path):
    rng = random.Random(7)
    async with SimServer(SimConfig(seed=9, latency_scale=0.06, mean_completion_tokens=80,
                                   faults={"500": 0.1, "429": 0.05}, retry_after_s=0.01), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 32},
                                                   {"name": "b", "n": 200, "concurrency": 16}],
                          tables={"engine": {"reconstruct": False}})
        rd = RunDir(cfg.run_dir)
        acknowledged: set[tuple[str, str]] = set()
        kills = 0
        for _ in range(6):
            proc = await start_run(cfg)
            await asyncio.sleep(rng.uniform(0.6, 1.6))
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            await proc.wait()
            for ds in ("a", "b"):
                ids = read_ids(rd.responses(ds))  # tolerates nothing: a torn line would fail orjson here
                assert len(ids) == len(set(ids)), "an id written twice"
                now = {(ds, i) for i in ids}
                assert acknowledged <= now | {x for x in acknowledged if x[0] != ds}
                acknowledged |= now
        proc = await start_run(cfg)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, out.decode()[-2000:]
    assert kills >= 3
    for ds, n in (("a", 400), ("b", 200)):
        answered = read_ids(rd.responses(ds))
        failed = read_ids(rd.failures(ds))
        assert len(answered) == len(set(answered))
        assert len(answered) + len(failed) == n
        assert {i for d, i in acknowledged if d == ds} <= set(answered)
    assert TEST_KEY not in (rd.root / "events.log").read_text()


def test_torn_last_line_is_cut_and_logged(tmp_path):
    from draftgen.core.rundir import JsonlAppender
    path = tmp_path / "responses.jsonl"
    path.write_bytes(orjson.dumps({"id": "1"}) + b"\n" + b'{"id": "2", "content": "half')
    appender = JsonlAppender(path)
    assert appender.cut_bytes > 0
    appender.append({"id": "3"})
    appender.close()
    assert read_ids(path) == ["1", "3"]
