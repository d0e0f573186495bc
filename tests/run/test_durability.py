"""What an OS crash (or a power cut) leaves: only what was fsynced. A fault-injecting file layer keeps,
per run file, the length known durable at its last fsync and "crashes" by cutting each file back to
it; the next run must still keep the simulator's bill within max_usd."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


class CrashableDisk:
    """The page cache, for the .jsonl files under `root`: what an fsync covered survives `crash()`, the
    rest is cut off. After `freeze()` (the moment of the crash) an fsync fails and covers nothing, so
    nothing more counts as durable (and no request whose line needs it leaves)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = str(root)
        self.fds: dict[int, str] = {}
        self.durable: dict[str, int] = {}
        self.fsyncs = 0
        self.frozen = False
        real_open, real_dup, real_close, real_fsync = os.open, os.dup, os.close, os.fsync

        def fake_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            p = os.path.abspath(os.fspath(path))
            if p.startswith(self.root) and p.endswith(".jsonl") and flags & (os.O_WRONLY | os.O_RDWR):
                self.fds[fd] = p
                self.durable.setdefault(p, os.fstat(fd).st_size)  # what was there before is on disk for good
            return fd

        def fake_dup(fd: int) -> int:
            new = real_dup(fd)
            if fd in self.fds:
                self.fds[new] = self.fds[fd]
            return new

        def fake_close(fd: int) -> None:
            self.fds.pop(fd, None)
            real_close(fd)

        def fake_fsync(fd: Any) -> None:
            path = self.fds.get(fd) if isinstance(fd, int) else None
            if path is not None:
                if self.frozen:
                    raise OSError(errno.EIO, "the machine crashed")
                size = os.fstat(fd).st_size  # what was written when the fsync began
                real_fsync(fd)
                self.durable[path] = max(self.durable.get(path, 0), size)
                self.fsyncs += 1
                return
            real_fsync(fd)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "dup", fake_dup)
        monkeypatch.setattr(os, "close", fake_close)
        monkeypatch.setattr(os, "fsync", fake_fsync)

    def freeze(self) -> None:
        self.frozen = True

    def crash(self) -> dict[str, int]:
        """Cut every tracked file back to its durable length; returns the bytes lost per file."""
        lost = {}
        for path, keep in self.durable.items():
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if size > keep:
                os.truncate(path, keep)
                lost[os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)] = size - keep
        self.frozen = False
        return lost


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


# -- the unit: a `sent` line is durable before the request may leave ------------------------------


async def test_send_does_not_return_before_an_fsync_covering_its_line(tmp_path, monkeypatch):
    disk = CrashableDisk(monkeypatch, tmp_path)
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    path = str(tmp_path / "spend.jsonl")
    real_fsync = os.fsync
    gate = threading.Event()

    def held_fsync(fd: int) -> None:  # the disk is slow: the fsync waits until the test lets it go
        gate.wait(10)
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", held_fsync)

    tickets = [spend.reserve("a", f"p{i}", 0.01) for i in range(50)]
    sends = [asyncio.create_task(spend.send_grouped(t)) for t in tickets]
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not any(s.done() for s in sends) and not any(t.sent for t in tickets)
    assert disk.durable[path] == 0 < os.path.getsize(path)  # written, not durable: nothing may leave
    gate.set()
    await asyncio.gather(*sends)
    assert all(t.sent for t in tickets)
    assert disk.durable[path] == os.path.getsize(path)  # every sent line covered by an fsync
    assert 1 <= disk.fsyncs <= 2  # group commit: the 50 sends of the moment share one or two fsyncs

    # The plain `send` (the smoke test's) fsyncs before it returns too.
    before = disk.fsyncs
    t = spend.reserve("a", "q", 0.01)
    spend.send(t)
    assert t.sent and disk.fsyncs == before + 1 and disk.durable[path] == os.path.getsize(path)
    # A crash now loses none of the 51 attempts that may be billed.
    spend.close()
    disk.crash()
    again = SpendLedger.read(tmp_path / "spend.jsonl")
    assert len(again.pending) == 51 and again.pending_usd == pytest.approx(0.51)


async def test_an_fsync_that_fails_sends_nothing_and_books_nothing(tmp_path, monkeypatch):
    disk = CrashableDisk(monkeypatch, tmp_path)
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    disk.freeze()
    t = spend.reserve("a", "p", 0.01)
    from draftgen.core.errors import DiskError
    with pytest.raises(DiskError, match="spend.jsonl"):
        await spend.send_grouped(t)
    assert not t.sent and spend.reserved_usd == 0
    spend.close()
    again = SpendLedger.read(tmp_path / "spend.jsonl")
    assert again.committed_usd == 0  # its line says "refused": not counted as in flight


# -- the run: an OS crash mid-run, then a run with the same max_usd -------------------------------


def _config(tmp_path: Path, url: str, max_usd: float | None, n: int = 600) -> Any:
    tables: dict[str, Any] = {"api": {"generation_lookup_s": 2}}
    if max_usd is not None:
        tables["budget"] = {"max_usd": max_usd}
    return make_config(tmp_path, url, [{"name": "a", "n": n, "concurrency": 40, "max_tokens": 256}], tables=tables)


@pytest.mark.slow
async def test_an_os_crash_mid_run_loses_no_spend_and_the_next_run_keeps_the_ceiling(tmp_path, monkeypatch):
    max_usd = 0.12
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.15, mean_completion_tokens=150), port=0) as sim:
        cfg = _config(tmp_path, sim.base_url, max_usd)
        disk = CrashableDisk(monkeypatch, cfg.run_dir)
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        while dataset_row(engine, "a").done < 80 and not task.done():
            await asyncio.sleep(0.01)
        assert not task.done()
        disk.freeze()        # the kernel panics: nothing written from now on reaches the disk
        engine.stop()
        await task
        # The requests cut off run on at the provider and are billed.
        await until(lambda: sim.stats.in_flight == 0 and sim.stats.generations_running == 0, "the billing to end")
        billed_1 = sim.stats.billed_usd
        lost = disk.crash()
        print(f"run 1 billed ${billed_1:.4f}; bytes lost in the crash: {lost}")
        assert 0 < billed_1 < max_usd

        events: list[tuple[str, str, str]] = []
        engine2 = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        await engine2.run()
        billed = sim.stats.billed_usd
    print(f"billed ${billed:.4f} of max_usd ${max_usd}; run 2 counted ${engine2.spend.committed_usd:.4f}")
    assert billed <= max_usd + 1e-9
    assert billed > billed_1   # the second run did ask
    # Every answer on disk is there once; no prompt answered twice that was acknowledged.
    ids = [x["id"] for x in _lines(RunDir(cfg.run_dir).responses("a"))]
    assert len(ids) == len(set(ids))


@pytest.mark.slow
async def test_a_ledger_behind_its_answers_counts_their_cost_once(tmp_path):
    """An OS crash of a version that did not fsync lost the tail of spend.jsonl but not of
    responses.jsonl: the answers with no `sent` line count at their recorded cost, once."""
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=150), port=0) as sim:
        cfg = _config(tmp_path, sim.base_url, None, n=200)
        await Engine(cfg, TEST_KEY, seed=1).run()
        billed_1 = sim.stats.billed_usd
        rd = RunDir(cfg.run_dir)
        lines = rd.spend.read_bytes().splitlines(keepends=True)
        rd.spend.write_bytes(b"".join(lines[:len(lines) // 4]))  # the ledger's last three quarters lost
        kept = SpendLedger.read(rd.spend).committed_usd
        assert kept < 0.7 * billed_1

        max_usd = billed_1 + 0.05
        cfg = _config(tmp_path, sim.base_url, max_usd, n=800)
        events: list[tuple[str, str, str]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        await engine.run()
        billed = sim.stats.billed_usd
        found = [e for e in events if e[1] == "unledgered"]
        print(f"billed ${billed:.4f} of max_usd ${max_usd:.4f}; {found}")
        assert billed <= max_usd + 1e-9
        assert len(found) == 1 and "answer(s)" in found[0][2]
        n_found = [x for x in _lines(rd.spend) if x["e"] == "found"]
        assert len(n_found) == 1 and n_found[0]["n"] > 100
        assert n_found[0]["c"] + kept >= billed_1 - 1e-6  # with what the ledger kept, all of run 1

        # The next opening counts them as covered: no second `found` line, the same spend.
        before = SpendLedger.read(rd.spend).settled_usd
        events.clear()
        await Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text()))).run()
        assert not [e for e in events if e[1] == "unledgered"]
        assert len([x for x in _lines(rd.spend) if x["e"] == "found"]) == 1
        assert SpendLedger.read(rd.spend).settled_usd >= before
        assert sim.stats.billed_usd <= max_usd + 1e-9


async def test_answers_the_ledger_has_but_responses_lost_are_reported_and_stay_counted(tmp_path):
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=50), port=0) as sim:
        cfg = _config(tmp_path, sim.base_url, None, n=30)
        await Engine(cfg, TEST_KEY, seed=1).run()
        rd = RunDir(cfg.run_dir)
        spent = SpendLedger.read(rd.spend).settled_usd
        lines = rd.responses("a").read_bytes().splitlines(keepends=True)
        rd.responses("a").write_bytes(b"".join(lines[:-5]))  # the answers' tail lost, not the ledger's
        events: list[tuple[str, str, str]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        await engine.run()
    lost = [e for e in events if e[1] == "answers_lost"]
    assert len(lost) == 1 and "5 prompt(s)" in lost[0][2]
    assert dataset_row(engine, "a").done == 30 and engine.spend.settled_usd > spent  # asked again, both counted
