"""The spend ledger writes the lines of one event-loop tick with one write, and a `sent` line is still
written (and fsynced) before its request may leave; so do the records (responses.jsonl, failures.jsonl),
each record's fate told to the record book."""

from __future__ import annotations

import asyncio
import errno
import os

import orjson
import pytest

from draftgen.core.errors import DiskError
from draftgen.core.generate.money.spend import SpendLedger

REAL_WRITE = os.write


class WriteSpy:
    """os.write, passed through, counting the writes to one file (and failing them while `full`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.writes: list[bytes] = []
        self.full = False

    def __call__(self, fd: int, data: bytes) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target == self.path:
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.writes.append(bytes(data))
        return REAL_WRITE(fd, data)


def lines(path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n")
    return [orjson.loads(x) for x in data.splitlines()]


async def test_the_lines_of_one_tick_go_out_in_one_write(tmp_path, monkeypatch):
    path = tmp_path / "spend.jsonl"
    spend = SpendLedger(path)
    spend.open()
    spy = WriteSpy(str(path))
    monkeypatch.setattr(os, "write", spy)
    tickets = [spend.reserve("a", f"p{i}", 0.01) for i in range(20)]
    for i, t in enumerate(tickets):  # what 20 answers landing in one tick book: their generation ids and ends
        spend.generation(t, f"gen-{i}")
        spend.answered(t, 0.001)
    await asyncio.sleep(0)
    # One write; each end line carries its attempt's generation id (no gen line of its own).
    assert len(spy.writes) == 1
    assert [(x["e"], x["a"], x["g"]) for x in lines(path)] == [("end", t.id, f"gen-{i}") for i, t in enumerate(tickets)]
    spend.close()


async def test_a_generation_id_whose_answer_comes_in_a_later_tick_gets_its_own_line(tmp_path, monkeypatch):
    """A streamed answer: the id is known with the headers, the end comes ticks later. The id goes out in
    the write of the tick it came in (a crash before the end can still look the attempt up), and the
    next run reads it back from either line."""
    path = tmp_path / "spend.jsonl"
    spend = SpendLedger(path)
    spend.open()
    spy = WriteSpy(str(path))
    monkeypatch.setattr(os, "write", spy)
    early, late = spend.reserve("a", "p0", 0.01), spend.reserve("a", "p1", 0.01)
    spend.send(early)
    spend.send(late)
    spend.generation(early, "gen-early")
    spend.generation(late, "gen-late")
    spend.answered_unpriced(late, 0.002)  # the same tick: the id rides on the end line
    await asyncio.sleep(0)
    assert [x["e"] for x in lines(path)] == ["sent", "sent", "end", "gen"]
    assert lines(path)[2]["g"] == "gen-late" and lines(path)[3] == {"e": "gen", "a": early.id, "g": "gen-early"}
    writes = len(spy.writes)
    assert writes == 3  # two sent lines at once (outside a tick's write: send() fsyncs each), then one write
    spend.close()  # the run dies with `early` still in flight
    reread = SpendLedger(path)
    reread.open()
    assert {p.id: p.gen for p in reread.lookups()} == {early.id: "gen-early", late.id: "gen-late"}
    reread.close()


async def test_a_sent_line_is_written_before_its_fsync_begins(tmp_path, monkeypatch):
    path = tmp_path / "spend.jsonl"
    spend = SpendLedger(path)
    spend.open()
    spy = WriteSpy(str(path))
    monkeypatch.setattr(os, "write", spy)
    real_fsync = os.fsync
    seen_at_fsync: list[int] = []

    def fsync(fd: int) -> None:
        seen_at_fsync.append(os.fstat(fd).st_size)
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    tickets = [spend.reserve("a", f"p{i}", 0.01) for i in range(30)]
    await asyncio.gather(*(spend.send_grouped(t) for t in tickets))
    assert all(t.sent for t in tickets)
    # Every sent line was in the file when the fsync that let its request go began.
    assert seen_at_fsync and seen_at_fsync[-1] == path.stat().st_size
    assert sorted(x["a"] for x in lines(path)) == sorted(t.id for t in tickets)
    assert len(spy.writes) <= 2  # the tick's 30 lines, not one write each
    spend.close()


async def test_a_refused_tick_write_sends_nothing_and_keeps_every_line_in_order(tmp_path, monkeypatch):
    path = tmp_path / "spend.jsonl"
    spend = SpendLedger(path)
    spend.open()
    spy = WriteSpy(str(path))
    monkeypatch.setattr(os, "write", spy)
    first = spend.reserve("a", "p0", 0.01)
    await spend.send_grouped(first)
    spy.full = True
    spend.answered(first, 0.002)           # after its attempt: held for the next write
    late = spend.reserve("a", "p1", 0.01)
    with pytest.raises(DiskError, match="spend.jsonl"):
        await spend.send_grouped(late)     # its line could not be written: it must not leave
    spend.release(late)                    # as a request (request.py) does
    assert not late.sent and spend.reserved_usd == 0
    spy.full = False
    spend.close()                          # space back: every line, in order, none torn
    kinds = [(x["e"], x["a"]) for x in lines(path)]
    # `late` is on the ledger as sent and refused, or not at all: either way it counts nothing.
    assert kinds[:2] == [("sent", first.id), ("end", first.id)]
    assert kinds[2:] in ([], [("sent", late.id), ("end", late.id)])
    again = SpendLedger.read(path)
    assert again.committed_usd == pytest.approx(0.002) and not again.pending


async def test_a_records_file_tells_its_owner_what_each_write_took_and_keeps_nothing_it_refused(tmp_path, monkeypatch):
    """The records' appender (record_book.py): the lines of a tick in one write, its owner told how many went
    out; a refused write hands the rest to the owner (held in memory there) instead of retrying it later."""
    from draftgen.core.rundir import JsonlAppender
    path = tmp_path / "responses.jsonl"
    heard: list[tuple[int, str]] = []
    f = JsonlAppender(path, coalesce=True, on_flush=lambda n, e: heard.append((n, type(e).__name__)))
    spy = WriteSpy(str(path))
    monkeypatch.setattr(os, "write", spy)
    for i in range(5):
        f.append({"id": f"p{i}"})
    await asyncio.sleep(0)
    assert heard == [(5, "NoneType")] and len(spy.writes) == 1 and len(lines(path)) == 5
    spy.full = True
    for i in range(5, 8):
        f.append({"id": f"p{i}"})
    await asyncio.sleep(0)  # nothing raised: the owner heard it
    assert heard[-1] == (0, "DiskError")
    spy.full = False
    f.append({"id": "p8"})
    await f.synced()
    assert [x["id"] for x in lines(path)] == ["p0", "p1", "p2", "p3", "p4", "p8"]  # p5-p7 are the owner's now
    f.append_now({"id": "p5"})  # written before it returns, the owner not told (it asked for it)
    assert lines(path)[-1] == {"id": "p5"} and heard[-1] == (1, "NoneType")
    f.close()


async def test_a_runs_records_go_out_a_tick_at_a_time(tmp_path, monkeypatch):
    """200 answers at 50 in flight: responses.jsonl gets far fewer writes than records, every record whole."""
    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.live import snapshot as snap
    from draftgen.core.rundir import RunDir
    from draftgen.simulator import SimConfig, SimServer
    from tests.helpers import TEST_KEY, make_config, read_ids
    async with SimServer(SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 50}])
        spy = WriteSpy(str(RunDir(cfg.run_dir).responses("a")))
        monkeypatch.setattr(os, "write", spy)
        assert await Engine(cfg, TEST_KEY, seed=1).run() == snap.RunState.DONE
    ids = read_ids(RunDir(cfg.run_dir).responses("a"))
    assert len(ids) == len(set(ids)) == 200
    assert len(spy.writes) < 100, len(spy.writes)  # one write a record would be 200
