"""A cancel that meets a loop's timed wait as the wait's event is set ends the loop.

Python 3.11's `asyncio.wait_for` swallows a cancel that arrives as its inner wait completes (see
tests/money/test_settle_close.py, the settler's pricing loop): the loops in core wait with
`asyncio.timeout()`, which passes the cancel on. Here: a run that ends with answers held in memory waits
for the disk (Engine._wait_for_disk, a retry every HELD_RETRY_S); a resume (which wakes that wait) in the
turn the run is cancelled left the loop retrying the full disk, the cancelled run never ending. And a
request backing off before a retry (request.py `_back_off`) waits for the run's close: stop now closes
the run in the turn it cancels the requests, and each one backing off returned instead of ending
cancelled (its prompt handed back all the same)."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from draftgen.core.generate.loop.engine import HELD_RETRY_S, Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until
from tests.run.test_disk_faults import FullDisk


def awaiting(task: asyncio.Task) -> list[str]:
    """The coroutines `task` is suspended in, outermost first."""
    names, coro = [], task.get_coro()
    while coro is not None and hasattr(coro, "cr_frame"):
        names.append(coro.cr_frame.f_code.co_name if coro.cr_frame is not None else "?")
        coro = coro.cr_await
    return names


@pytest.mark.parametrize("turns", [0, 1])
async def test_a_cancel_in_the_turn_the_held_answers_wait_wakes_ends_the_run(tmp_path, monkeypatch, turns):
    monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(tmp_path / "spool"))
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        disk = FullDisk(run.root, errno.EROFS, spare=run.spend.name)  # the spend ledger's lines go through
        monkeypatch.setattr(os, "write", disk)
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        try:
            await until(lambda: dataset_row(engine, "a").done >= 8, "8 answers")
            disk.full = True
            await until(lambda: engine.state == snap.RunState.PAUSED and engine.in_flight == 0,
                        "paused on the read-only disk, nothing in flight")
            assert engine.book.held_answers >= 1
            engine.drain()
            await until(lambda: "waiting for the disk" in engine.waiting(), "the drain waits for the disk")
            await until(lambda: "_wait_for_disk" in awaiting(task), "the run's end waits for the disk")
            engine.resume()  # wakes the wait: the disk is tried again (still full)
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=3 * HELD_RETRY_S)
            assert task in done and task.cancelled(), "the cancelled run went on waiting for the disk"
        finally:
            if not task.done():
                engine.spool_held()  # let it end (spooled), whichever way the test went
                await asyncio.wait({task}, timeout=30)


async def test_stop_now_cancels_the_requests_backing_off(tmp_path):
    async with SimServer(SimConfig(seed=4, faults={"429": 1.0}, retry_after_s=60.0, fixed_latency_s=0.01,
                                   mean_completion_tokens=20), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 6, "concurrency": 3}])
        engine = Engine(cfg, TEST_KEY, seed=1)
        run = asyncio.create_task(engine.run())
        try:
            await until(lambda: engine._loop is not None and engine._loop.service.backing_off == 3,
                        "3 requests backing off (Retry-After 60 s)")
            assert engine._loop is not None
            requests = set(engine._loop.service.tasks)
            engine.stop()
            await asyncio.wait(requests, timeout=30)
            assert [t.cancelled() for t in requests] == [True] * 3, "a request backing off returned"
            assert await asyncio.wait_for(run, 30) == snap.RunState.STOPPED
        finally:
            if not run.done():
                run.cancel()
                await asyncio.wait({run}, timeout=30)
