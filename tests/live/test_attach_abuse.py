"""A hundred attach clients at once against a live run: readers, garbage senders and clients that
never read. The run finishes with every prompt answered and nothing a client sent changes it."""

from __future__ import annotations

import asyncio
import stat

import orjson
import pytest

from draftgen.core.live import snapshot as snap
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config, read_ids


@pytest.mark.slow
async def test_a_hundred_clients_at_once_change_nothing(tmp_path):
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 600, "concurrency": 64}],
                          tables={"engine": {"reconstruct": False}})
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True)
        await pipeline.start()
        sock = RunDir(cfg.run_dir).socket
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        seen = {"snapshots": 0}

        async def reader() -> None:
            r, w = await asyncio.open_unix_connection(str(sock), limit=1 << 24)
            try:
                while line := await r.readline():
                    if orjson.loads(line).get("type") == "snapshot":
                        seen["snapshots"] += 1
            finally:
                w.close()

        async def garbage() -> None:
            r, w = await asyncio.open_unix_connection(str(sock))
            for cmd in (b'{"type": "pause"}\n', b'{"action": "quit", "drain": false}\n', b"\x00\xff" * 4096,
                        b"p\nq\nx\n", orjson.dumps({"type": "control", "call": "stop"}) + b"\n"):
                w.write(cmd)
                await w.drain()
                await asyncio.sleep(0.05)
            await asyncio.sleep(3600)  # keeps the connection open, never reads

        async def silent() -> None:
            r, w = await asyncio.open_unix_connection(str(sock))
            try:
                await asyncio.sleep(3600)  # connects and never reads
            finally:
                w.close()

        clients = [asyncio.create_task(f()) for f in [reader] * 40 + [garbage] * 30 + [silent] * 30]

        async def all_accepted() -> None:
            # the server accepts on its own schedule: wait for the state, never for a fixed time
            while pipeline._attach.clients + pipeline._attach.dropped_clients < 100:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(all_accepted(), 60)
        assert pipeline._attach.refused_clients == 0
        state = await asyncio.wait_for(pipeline.generate(), 120)
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await pipeline.close()
    assert state == snap.RunState.DONE
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == len(set(ids)) == 600
    assert pipeline.engine.alert == "" and pipeline.engine.state == snap.RunState.DONE
    assert seen["snapshots"] > 40  # the readers were served all along
