"""A records file's group fsync that fails (RecordBook.synced, JsonlAppender `on_sync_error`): the run is paused
with the reason, nothing more is sent while it is, and resuming goes on to the end with every answer written."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from draftgen.core import rundir
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, read_ids, until


def _fail_once(monkeypatch, name: str) -> list[int]:
    """The first group fsync of a file called `name` fails (EIO) in its thread; returns how many did."""
    real = rundir._fsync_and_close
    failed: list[int] = []

    def fsync(fd: int) -> None:
        if not failed and os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            failed.append(fd)
            os.close(fd)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(rundir, "_fsync_and_close", fsync)
    return failed


@pytest.mark.parametrize("name", ["responses.jsonl", "failures.jsonl"])
async def test_a_records_fsync_that_fails_pauses_the_run_and_resume_finishes_it(tmp_path, monkeypatch, name):
    """A failed fsync of either records file holds the run with its path and reason: a request's record is
    not acknowledged as durable, so nothing more leaves until the user resumes."""
    failed = _fail_once(monkeypatch, name)
    # For failures.jsonl: prompts the server refuses as theirs (400 invalid_prompt), which fail for good.
    scenarios = {"invalid_prompt": {"rate": 0.3}} if name == "failures.jsonl" else {}
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=60, scenarios=scenarios),
                         port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 4}])
        run = RunDir(cfg.run_dir)
        events: list[tuple[str, str]] = []
        engine = Engine(cfg, TEST_KEY, on_event=lambda p: events.append((p.kind, p.text())), seed=1)
        task = asyncio.create_task(engine.run())
        await until(lambda: engine.state == snap.RunState.PAUSED and engine.in_flight == 0, "paused and idle")
        assert failed
        assert f"{run.root / 'a' / name}" in engine.alert and "may not survive an OS crash" in engine.alert, \
            engine.alert
        assert any(kind == "alert" and "may not survive an OS crash" in text for kind, text in events)
        requests = sim.stats.requests_total
        await asyncio.sleep(0.2)
        assert sim.stats.requests_total == requests, "a request left while the run was paused"
        assert not task.done()
        engine.resume()
        assert await asyncio.wait_for(task, 30) == snap.RunState.DONE
    ids = read_ids(run.responses("a")) + read_ids(run.failures("a"))
    assert sorted(ids) == sorted(f"a-{i}" for i in range(30))
    row = dataset_row(engine, "a")
    assert row.done + row.failed == 30 and (row.failed > 0) == (name == "failures.jsonl")
