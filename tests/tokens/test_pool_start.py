"""The live reconstruction's workers start beside the run, not before it: `RunReconstructor.start`
returns while they still load the tokenizer (the main process loaded it first: a tokenizer that
cannot load is still an error before anything is sent). What is submitted meanwhile is held and
reconstructed once they are ready, each answer once; a worker that dies before it is ready is
replaced; closing while they start leaves no process behind. Real worker processes, held back by a
gate file (tests/tokens/gated_worker.py), the real Kimi tokenizer."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import psutil
import pytest

from draftgen.core.errors import TokenizerError
from draftgen.core.tokens.during_run import RunReconstructor
from tests.helpers import until
from tests.tokens.gated_worker import BrokenWorkerSpec, GatedSpec
from tests.tokens.test_tokens import index_lines, make_config, response, write_responses


def _workers() -> list[psutil.Process]:
    """This process's reconstruction workers: the children of its forkserver."""
    return [p for child in psutil.Process().children() if any("forkserver" in c for c in child.cmdline())
            for p in child.children()]


def _gated(tmp_path: Path, workers: int = 1) -> tuple[RunReconstructor, Path]:
    config = make_config(tmp_path)
    live = RunReconstructor(config, workers=workers)
    gate = tmp_path / "gate"
    live._pool._spec = GatedSpec.of(live._spec, gate)  # the workers wait for the gate; the main process does not
    return live, gate


async def test_start_returns_before_the_workers_are_ready_and_what_came_meanwhile_is_reconstructed_once(
        tmp_path: Path) -> None:
    live, gate = _gated(tmp_path, workers=2)
    # The workers cannot be ready before the gate opens: a start that waited for them would hang here.
    await asyncio.wait_for(live.start(), 60)
    records = [response(i) for i in range(30)]
    write_responses(live.config, "A", records)
    for rec in records:
        live.submit("A", rec)
    live.submit("A", records[3])  # a duplicate: ignored
    await asyncio.sleep(0.2)  # past the batching delay: the batches are held, not lost
    waiting = live.progress()
    assert waiting.state == "running" and waiting.done == 0 and waiting.total == 30, waiting
    assert dict(waiting.detail)["waiting"] == "30"
    gate.touch()
    await asyncio.wait_for(live.close(), 120)
    ids = [e["id"] for e in index_lines(live.config, "A")]
    assert sorted(ids) == sorted(r["id"] for r in records) and len(ids) == 30
    done = live.progress()
    assert done.state == "done" and done.done == done.total == 30 and live.restarts == 0, done


async def test_a_worker_that_dies_before_it_is_ready_is_replaced_and_its_answers_wait_for_the_new_one(
        tmp_path: Path) -> None:
    live, gate = _gated(tmp_path)
    events: list[tuple[str, str, str]] = []
    live._pool._event = lambda p: events.append((p.level, p.kind, p.text()))
    await asyncio.wait_for(live.start(), 60)
    records = [response(i) for i in range(12)]
    for rec in records:
        live.submit("A", rec)
    await until(lambda: len(_workers()) == 1, "the worker process")
    os.kill(_workers()[0].pid, signal.SIGKILL)
    await until(lambda: live.restarts == 1, "the dead worker noticed")
    gate.touch()
    await asyncio.wait_for(live.close(), 120)
    assert sorted(e["id"] for e in index_lines(live.config, "A")) == sorted(r["id"] for r in records)
    done = live.progress()
    assert done.state == "done" and done.done == done.total == 12, done
    assert [e[1] for e in events] == ["tokens_worker_died"], events


async def test_closing_while_the_workers_start_leaves_no_worker_behind(tmp_path: Path) -> None:
    live, gate = _gated(tmp_path)
    await asyncio.wait_for(live.start(), 60)
    await until(lambda: len(_workers()) == 1, "the worker process")
    closing = asyncio.ensure_future(live.close())
    await asyncio.sleep(0.2)
    assert not closing.done()  # it waits for the worker that is starting, it does not abandon it
    gate.touch()
    await asyncio.wait_for(closing, 120)
    await until(lambda: not _workers(), "the worker gone")
    assert live.progress().state == "done"


async def test_workers_that_cannot_start_at_all_stop_reconstruction_loudly_and_lose_no_count(tmp_path: Path) -> None:
    """Known only after the run's first requests went out: reconstruction stops for the run and says how
    to finish (docs/workflow.md), as when the workers keep dying; the answers stay in responses.jsonl."""
    config = make_config(tmp_path)
    events: list[tuple[str, str, str]] = []
    live = RunReconstructor(config, workers=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
    live._pool._spec = BrokenWorkerSpec.of(live._spec)
    await asyncio.wait_for(live.start(), 60)
    for i in range(10):
        live.submit("A", response(i))
    await asyncio.wait_for(live.close(), 120)
    p = live.progress()
    assert p.state == "failed" and p.done == 0 and p.total == 10, p
    assert "new worker processes could not start" in p.message and f"draftgen tokens {config.path}" in p.message, p
    assert [e[1] for e in events] == ["tokens_worker_died", "tokens_failed"], events
    assert not _workers()


async def test_a_tokenizer_that_cannot_load_fails_start_before_any_worker_starts(tmp_path: Path) -> None:
    live = RunReconstructor(make_config(tmp_path, tokenizer=str(tmp_path / "missing-tokenizer")), workers=1)
    with pytest.raises(TokenizerError, match="missing-tokenizer"):
        await live.start()
    assert live._pool.detach() is None and not _workers()
    await live.close()


async def test_a_start_cancelled_while_the_workers_are_spawned_leaves_no_worker_behind(tmp_path: Path) -> None:
    """The run stopped while the first pool's processes were being started (in a thread): the pool the
    thread still makes is held by nothing, and goes with its workers (ProcessPoolExecutor's manager
    shuts them down once the executor is gone), not left running to the interpreter's exit."""
    import threading
    live, gate = _gated(tmp_path)
    pool = live._pool
    spawn, spawning, go_on = pool._spawn, threading.Event(), threading.Event()

    def held_spawn():  # type: ignore[no-untyped-def]  # the real spawn, once the start has been cancelled
        spawning.set()
        go_on.wait(30)
        return spawn()
    pool._spawn = held_spawn  # type: ignore[method-assign]
    opening = asyncio.ensure_future(pool.open())
    await until(spawning.is_set, "the spawn to begin")
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    go_on.set()
    await until(lambda: len(_workers()) == 1, "the worker the thread still started")
    gate.touch()  # the worker finishes its start-up and sees the shutdown
    await until(lambda: not _workers(), "the worker gone", 60)
    assert pool.detach() is None  # the cancelled start never became the run's pool


async def test_answers_past_the_workers_backlog_wait_on_disk_not_in_memory(tmp_path: Path) -> None:
    """Workers that cannot keep up (held back by the gate): past LIVE_BACKLOG batches per worker, a
    submitted answer is not kept in memory (its line is on disk) but counted waiting; once the workers
    catch up the answers left on disk are read back from it and reconstructed, each once."""
    live, gate = _gated(tmp_path)
    await asyncio.wait_for(live.start(), 60)
    bound = live.LIVE_BACKLOG * live.workers * live.BATCH_ANSWERS  # batches per worker, answers per live batch
    records = [response(i) for i in range(3 * bound)]
    write_responses(live.config, "A", records)
    for rec in records:
        live.submit("A", rec)
    await asyncio.sleep(live.FLUSH_AFTER_S + 0.1)  # past the batching delay
    kept = sum(len(batch) for _, batch in live._pool.held) + sum(len(d.buffer) for d in live._datasets.values())
    assert kept <= bound, f"{kept} answers kept in memory for {live.workers} worker(s) not ready"
    assert dict(live.progress().detail)["waiting"] == f"{len(records):,}"
    gate.touch()
    await asyncio.wait_for(live.close(), 180)
    ids = [e["id"] for e in index_lines(live.config, "A")]
    assert sorted(ids) == sorted(r["id"] for r in records) and len(ids) == len(records)
    done = live.progress()
    assert done.state == "done" and done.done == done.total == len(records), done


async def test_a_live_reconstruction_keeps_each_answered_id_once(tmp_path: Path) -> None:
    """The answered ids a live reconstruction keeps (those committed and those on their way) are one set,
    the token writer's own, not a copy beside it: a run kept each id's string and table entry twice, a
    share of the main process's growth per answer (BENCHMARKS.md, Memory per answer)."""
    config = make_config(tmp_path)
    live = RunReconstructor(config, workers=1)
    await asyncio.wait_for(live.start(), 60)
    records = [response(i) for i in range(40)]
    write_responses(config, "A", records)
    for rec in records:
        live.submit("A", rec)
    await asyncio.wait_for(live.wait_idle(), 120)
    ds = live._datasets["A"]
    answered = {r["id"] for r in records}
    holders = {id(s): s for obj in (ds, ds.writer) for s in vars(obj).values()
               if isinstance(s, set) and answered <= s}
    await asyncio.wait_for(live.close(), 60)
    assert len(index_lines(config, "A")) == len(records)
    assert len(holders) == 1, f"the answered ids are kept in {len(holders)} sets"


async def test_answers_left_on_disk_are_read_back_once_the_workers_catch_up_before_the_run_ends(
        tmp_path: Path) -> None:
    """The answers a run left on disk while its workers were behind are read back as soon as the queue has
    drained (a batch landed with at most a batch per worker queued), not only when the run ends: the
    read-back sat on the full-disk path alone, so a run's tokens stage stayed behind until its close."""
    live, gate = _gated(tmp_path)
    await asyncio.wait_for(live.start(), 60)
    bound = live.LIVE_BACKLOG * live.workers * live.BATCH_ANSWERS
    records = [response(i) for i in range(2 * bound)]
    write_responses(live.config, "A", records)
    for rec in records:
        live.submit("A", rec)
    assert sum(ds.behind for ds in live._datasets.values()) > 0  # some were left on disk
    gate.touch()
    # No wait_idle, no close: the run is still going.
    await until(lambda: live.progress().done == len(records), "every answer reconstructed during the run", 180)
    await asyncio.wait_for(live.close(), 120)
    ids = [e["id"] for e in index_lines(live.config, "A")]
    assert sorted(ids) == sorted(r["id"] for r in records) and len(ids) == len(records)
