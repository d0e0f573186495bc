"""Full and read-only disks: a write that fails pauses the run with a message naming the path,
nothing torn, nothing acknowledged lost, and the run goes on when space is back. One module
(over 400 lines) for every command that writes, so the two ways of failing a write are set up once.

Two real ways to make a write fail are used:
- in this process, `os.write` on the run's .jsonl files raises ENOSPC / EROFS / EFBIG (or writes
  half a line and stops, as a disk filling mid-line does): the stand-in for a full disk;
- in a child process, a low RLIMIT_FSIZE (SIGXFSZ ignored, as Python does): every write past the
  limit fails with EFBIG for real, in the kernel, whatever code makes it. The parent lifts the
  limit with prlimit(2) to give the space back.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from draftgen.core.config_load import load_config
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import INDEX_FILE, TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.core.tokens.workers import reconstruct_dataset
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, cli_env, dataset_row, make_config, until

REAL_WRITE = os.write
REASONS = {errno.ENOSPC: "the disk is full", errno.EROFS: "the disk is read-only",
           errno.EFBIG: "the file is too large"}


class FullDisk:
    """os.write for files under `root` whose name ends in .jsonl: fails while `full`."""

    def __init__(self, root: Path, err: int = errno.ENOSPC, short: bool = False, spare: str = "") -> None:
        self.root = str(root)
        self.spare = spare      # a file name still written while full
        self.err = err
        self.short = short      # write half the line, then stop: the disk filled mid-line
        self.full = False
        self.refused = 0

    def __call__(self, fd: int, data: bytes) -> int:
        if self.full:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(self.root) and target.endswith(".jsonl") and not (
                    self.spare and target.endswith(self.spare)):
                self.refused += 1
                if self.short and len(data) > 1:
                    return REAL_WRITE(fd, data[: len(data) // 2])
                raise OSError(self.err, os.strerror(self.err))
        return REAL_WRITE(fd, data)


def parsed_ids(path: Path) -> list[str]:
    """Ids of every line; fails the test on a torn or unparseable line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends with a torn line"
    return [orjson.loads(line)["id"] for line in data.splitlines()]


def on_disk(run: RunDir, name: str) -> list[str]:
    return parsed_ids(run.responses(name)) + parsed_ids(run.failures(name))


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fsize_limit(limit: int) -> Callable[[], None]:
    """preexec_fn: writes past `limit` bytes in any file fail with EFBIG (the hard limit stays open,
    so the parent can lift it again with prlimit)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


def cli(args: list[str], limit: int | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "draftgen.cli.main", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=fsize_limit(limit) if limit else None)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("draftgen: error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


# ---------------------------------------------------------------------------------------------
# The engine, in process


@pytest.mark.parametrize("err, short", [(errno.ENOSPC, False), (errno.EROFS, False), (errno.EFBIG, False),
                                        (errno.ENOSPC, True)], ids=["ENOSPC", "EROFS", "EFBIG", "short-write"])
async def test_a_failing_write_pauses_the_run_and_resume_loses_nothing(tmp_path, monkeypatch, err, short):
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.03, mean_completion_tokens=60,
                                   faults={"500": 0.15}, retry_after_s=0.01), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 150, "concurrency": 8}],
                          tables={"engine": {"max_attempts": 2}})
        run = RunDir(cfg.run_dir)
        # The spend ledger is spared: filled between two requests, the next request's ledger line would
        # be refused first, nothing sent and nothing held (test_ledger_coalesce.py pins that case).
        disk = FullDisk(run.root, err, short, spare=run.spend.name)
        monkeypatch.setattr(os, "write", disk)
        events: list[tuple[str, str, str]] = []
        engine = Engine(cfg, TEST_KEY, on_event=lambda p: events.append((p.level, p.kind, p.text())), seed=1)
        task = asyncio.create_task(engine.run())
        await until(lambda: dataset_row(engine, "a").done >= 25, "25 answers")
        disk.full = True
        await until(lambda: engine.state == snap.RunState.PAUSED, "the run pauses on the failed write")
        # The path that refused: an answer's file.
        assert str(run.root / "a") in engine.alert and REASONS[err] in engine.alert, engine.alert
        assert any(kind == "alert" and REASONS[err] in msg for _, kind, msg in events)
        await until(lambda: engine.in_flight == 0, "requests in flight finish")
        acknowledged = on_disk(run, "a")
        assert len(acknowledged) == len(set(acknowledged))
        ds = dataset_row(engine, "a")
        held = ds.done + ds.failed - len(acknowledged)
        assert held >= 1, "the answers that could not be written are held, not dropped"
        before = run.responses("a").read_bytes(), run.failures("a").read_bytes()
        requests = sim.stats.requests_total
        await asyncio.sleep(0.2)
        assert sim.stats.requests_total == requests, "nothing admitted while the disk is full"

        engine.resume()  # still full: stays paused, nothing written, nothing torn
        assert engine.state == snap.RunState.PAUSED and "Still paused" in engine.alert
        assert (run.responses("a").read_bytes(), run.failures("a").read_bytes()) == before

        disk.full = False
        engine.resume()
        assert engine.state == snap.RunState.RUNNING
        assert await asyncio.wait_for(task, 60) == snap.RunState.DONE
    final = on_disk(run, "a")
    assert sorted(final) == sorted(f"a-{i}" for i in range(150)), "every prompt answered or failed, once"
    assert set(acknowledged) <= set(final)
    assert disk.refused >= 2


async def test_a_refused_spend_ledger_line_sends_nothing_holds_nothing_and_resume_asks_it(tmp_path, monkeypatch):
    """Only the spend ledger refuses: a request leaves only once its line is there, so the run pauses
    naming the ledger with no record held (answers already in the air are written); with space back,
    resume asks every prompt, once."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.03, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        disk = FullDisk(run.spend)  # the ledger file alone
        monkeypatch.setattr(os, "write", disk)
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        await until(lambda: dataset_row(engine, "a").done >= 10, "10 answers")
        disk.full = True
        await until(lambda: engine.state == snap.RunState.PAUSED and engine.in_flight == 0, "paused and idle")
        assert f"cannot write {run.spend}: the disk is full" in engine.alert, engine.alert
        assert "only sent once the spend ledger has it on disk" in engine.alert, engine.alert
        assert engine.book.holding == 0
        written = on_disk(run, "a")
        assert len(written) == len(set(written)) == dataset_row(engine, "a").done
        disk.full = False
        engine.resume()
        assert await asyncio.wait_for(task, 60) == snap.RunState.DONE
    assert sorted(on_disk(run, "a")) == sorted(f"a-{i}" for i in range(60)), "every prompt answered, once"
    assert disk.refused >= 1


@pytest.mark.slow
async def test_quitting_on_a_full_disk_says_what_was_not_saved_and_tokens_follow_the_disk(tmp_path, monkeypatch):
    """Drain while the disk is still full and no spool place takes them either (spool.py), then stop:
    the run ends saying how many answers were not saved; the token store holds only answers that are in
    responses.jsonl; the next run asks the rest."""
    blocker = tmp_path / "not-a-dir"  # every spool place is under a file: mkdir fails for real
    blocker.write_text("")
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 80, "concurrency": 8}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"workers": 1}})
        run = RunDir(cfg.run_dir)
        # The spend ledger is spared: a request only leaves once its ledger line is written, so a full
        # ledger would keep the answers this test is about from ever being asked.
        disk = FullDisk(run.root, spare=run.spend.name)
        monkeypatch.setattr(os, "write", disk)
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        events = []
        sub = pipeline.hub.subscribe(maxsize=10_000)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())
        try:
            await until(lambda: dataset_row(pipeline.engine, "a").done >= 20, "20 answers")
            disk.full = True
            await until(lambda: pipeline.engine.state == snap.RunState.PAUSED, "paused on the full disk")
            await until(lambda: pipeline.engine.in_flight == 0, "requests in flight finish")
            pipeline.quit(drain=True)
            await until(lambda: "waiting for the disk" in pipeline.engine.waiting(), "the drain waits for the disk")
            monkeypatch.setenv("DRAFTGEN_SPOOL_DIR", str(blocker / "spool"))
            monkeypatch.setenv("HOME", str(blocker / "home"))
            monkeypatch.setattr(tempfile, "tempdir", str(blocker / "tmp"))
            pipeline.quit(drain=False)  # stop now: the spool is tried, and refused everywhere
            await asyncio.wait_for(task, 60)
        finally:
            await pipeline.close()
        while (item := sub.get_nowait()) is not None:
            if item[0] == "event":
                events.append(item[1])
        assert "LOST" in pipeline.snapshot().held
        saved = parsed_ids(run.responses("a"))
        assert dataset_row(pipeline.engine, "a").done == len(saved), "the answered count is what is on disk"
        unsaved = [e for e in events if e.kind == "unsaved"]
        assert unsaved and str(run.responses("a")) in unsaved[0].message, [e.message for e in events][-5:]
        tokens = [e.id for e in TokenReader(run.tokens("a")).entries]
        assert set(tokens) <= set(saved), "token ids of an answer that is not in responses.jsonl"

        # Space is back: the next run asks what was not saved; answers and tokens agree, once each.
        disk.full = False
        pipeline = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 60) == snap.RunState.DONE
        finally:
            await pipeline.close()
    saved = parsed_ids(run.responses("a"))
    assert sorted(saved) == sorted(f"a-{i}" for i in range(80))
    assert sorted(e.id for e in TokenReader(run.tokens("a")).entries) == sorted(saved)


async def test_space_back_before_quitting_writes_what_was_held(tmp_path, monkeypatch):
    async with SimServer(SimConfig(seed=5, fixed_latency_s=0.05, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        disk = FullDisk(run.root)
        monkeypatch.setattr(os, "write", disk)
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        # The disk fills while all 8 are in the air (their lines are already on the spend ledger), so
        # their answers are the ones held; filled between two requests, the next `sent` line would be
        # refused first and nothing would be held.
        # (The ledger writes a tick's lines at its end: wait until the 8 `sent` lines are in the file.)
        await until(lambda: dataset_row(engine, "a").done >= 10 and engine.in_flight == 8 and
                    run.spend.read_bytes().count(b'"e":"sent"') == dataset_row(engine, "a").done + 8,
                    "10 answers, 8 in flight, their lines on the ledger")
        disk.full = True
        await until(lambda: engine.state == snap.RunState.PAUSED and engine.in_flight == 0, "paused and idle")
        answered = dataset_row(engine, "a").done
        assert len(parsed_ids(run.responses("a"))) < answered
        disk.full = False
        engine.drain()
        await asyncio.wait_for(task, 30)
    assert len(parsed_ids(run.responses("a"))) == answered == dataset_row(engine, "a").done


# ---------------------------------------------------------------------------------------------
# A real file-size limit in a child process


async def test_headless_run_pauses_on_efbig_and_sigusr1_resumes(tmp_path):
    async with SimServer(SimConfig(seed=6, fixed_latency_s=0.02, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 200, "concurrency": 8}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            preexec_fn=fsize_limit(40_000))
        out: list[str] = []
        try:
            assert proc.stdout is not None
            while True:
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert line, "the run ended without pausing: " + "".join(out)[-3000:]
                out.append(line)
                if "ALERT" in line:
                    break
            # The alert is wrapped at 120 columns (never cut): read it whole.
            alert = " ".join([line.strip()] + [(await proc.stdout.readline()).decode().strip() for _ in range(3)])
            assert f"cannot write {run.responses('a')}: the file is too large" in alert, alert
            acknowledged = parsed_ids(run.responses("a"))  # every line whole, none twice
            assert 0 < len(acknowledged) == len(set(acknowledged)) < 200
            assert run.responses("a").stat().st_size <= 40_000
            # Space is back: lift the limit from outside, then tell the run to go on.
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            proc.send_signal(signal.SIGUSR1)
            rest, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, ("".join(out) + rest.decode())[-3000:]
    final = parsed_ids(run.responses("a")) + parsed_ids(run.failures("a"))
    assert sorted(final) == sorted(f"a-{i}" for i in range(200))
    assert set(acknowledged) <= set(final)


async def test_a_run_that_cannot_write_at_all_fails_clearly(tmp_path):
    async with SimServer(SimConfig(seed=6, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 20, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False}})
        run = RunDir(cfg.run_dir)
        # 600 bytes: run.json (a few KB) cannot be written.
        proc = await asyncio.to_thread(cli, ["run", str(cfg.path), "--headless", "--skip-smoke"], 600)
        assert_clean_error(proc, f"cannot write {run.root}", "the file is too large")
        # smoke.json, likewise.
        proc = await asyncio.to_thread(cli, ["smoke", str(cfg.path)], 100)
        assert_clean_error(proc, f"cannot write {run.root}", "the file is too large")
    assert not run.responses("a").exists() or parsed_ids(run.responses("a")) == []


# ---------------------------------------------------------------------------------------------
# Token store, `draftgen tokens`, merge

TOKEN_WRITER_CHILD = r"""
import resource, signal, sys
import numpy as np, orjson
from pathlib import Path
from draftgen.core.errors import DiskError
from draftgen.core.tokens.store import TokenWriter

folder = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
rng = np.random.default_rng(0)
samples = {f"s{i}": rng.integers(0, 163_000, size=int(rng.integers(50, 400)), dtype=np.uint32) for i in range(60)}
failures, written = [], []
writer = TokenWriter(folder)
for sid, ids in samples.items():
    try:
        writer.append(sid, ids, (ids % 2).astype(np.uint8), {"n": int(ids.shape[0])})
        written.append(sid)
    except Exception as e:
        failures.append([sid, type(e).__name__, str(e)])
        if len(failures) == 3:  # space comes back
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
writer.close()
np.savez(folder.parent / "expected.npz", **{sid: samples[sid] for sid in written})
print(orjson.dumps({"failures": failures, "written": written}).decode())
"""


def test_token_writer_rolls_back_a_failed_sample_and_goes_on(tmp_path):
    import numpy as np

    folder = tmp_path / "tokens"
    proc = subprocess.run([sys.executable, "-c", TOKEN_WRITER_CHILD, str(folder)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["failures"]) == 3
    for _sid, kind, message in result["failures"]:
        assert kind == "DiskError" and str(folder) in message and "too large" in message, (kind, message)
    reader = TokenReader(folder)
    expected = np.load(tmp_path / "expected.npz")
    assert [e.id for e in reader.entries] == result["written"]
    for entry in reader.entries:  # every committed sample reads back exactly what was appended
        ids, mask = reader.arrays(entry)
        assert np.array_equal(ids, expected[entry.id].astype(np.int64)), entry.id
        assert np.array_equal(mask, (expected[entry.id] % 2).astype(np.int64)), entry.id
    total = sum(e.length for e in reader.entries)
    assert (folder / "input_ids.bin").stat().st_size == 4 * total
    assert (folder / "loss_mask.bin").stat().st_size == total


BATCH_WRITER_CHILD = r"""
import resource, signal, sys
import numpy as np, orjson
from pathlib import Path
from draftgen.core.tokens.store import TokenWriter

folder = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
rng = np.random.default_rng(1)
batches = [[(f"b{b}s{i}", rng.integers(0, 163_000, size=int(rng.integers(1, 300)), dtype=np.uint32), {"b": b})
            for i in range(int(rng.integers(1, 9)))] for b in range(12)]
outcomes = []
with TokenWriter(folder) as writer:
    for b, batch in enumerate(batches):
        if b == 5:  # the disk fills up: this batch does not fit whole
            resource.setrlimit(resource.RLIMIT_FSIZE, (writer.tokens * 4 + 600, resource.RLIM_INFINITY))
        ids = b"".join(a.astype("<u4").tobytes() for _, a, _ in batch)
        mask = b"".join((a % 2).astype(np.uint8).tobytes() for _, a, _ in batch)
        try:
            writer.append_batch(ids, mask, [(sid, int(a.shape[0]), meta) for sid, a, meta in batch])
            outcomes.append("ok")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    if writer.ids != {sid for b, o in zip(batches, outcomes) if o == "ok" for sid, _, _ in b}:
        outcomes.append("the writer's ids differ from what it committed")
# The same samples appended one by one, for comparison.
with TokenWriter(folder.parent / "one_by_one") as writer:
    for batch, outcome in zip(batches, outcomes):
        for sid, a, meta in batch if outcome == "ok" else ():
            writer.append(sid, a, (a % 2).astype(np.uint8), meta)
print(orjson.dumps(outcomes).decode())
"""


def test_a_batch_of_samples_is_written_whole_or_not_at_all(tmp_path):
    """TokenWriter.append_batch (a live run's and `draftgen tokens`' batches of answers, one write per
    file): a batch that does not fit leaves the folder as it was before it, the next batches land after
    the last committed one, and the files are byte for byte those of the same samples appended one by one."""
    folder = tmp_path / "tokens"
    proc = subprocess.run([sys.executable, "-c", BATCH_WRITER_CHILD, str(folder)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert outcomes[:5] == ["ok"] * 5 and outcomes[6:] == ["ok"] * 6, outcomes
    assert outcomes[5].startswith("DiskError") and str(folder) in outcomes[5] and "too large" in outcomes[5]
    for name in ("input_ids.bin", "loss_mask.bin", "index.jsonl"):
        assert (folder / name).read_bytes() == (tmp_path / "one_by_one" / name).read_bytes(), name
    reader = TokenReader(folder)
    assert not any(e.id.startswith("b5s") for e in reader.entries) and reader.entries[-1].id.startswith("b11s")


LIVE_BATCH_CHILD = r"""
import asyncio, resource, signal, sys
import orjson
from pathlib import Path
from draftgen.core.config_load import config_from_dict
from draftgen.core.tokens.during_run import RunReconstructor
from draftgen.core.tokens.tokenizer import bundled_kimi_path

root = Path(sys.argv[1])
config = config_from_dict({"tokenizer": {"path": str(bundled_kimi_path())}, "output": {"dir": "run"},
                           "datasets": [{"name": "a", "prompts": "a.jsonl"}]}, root / "draftgen.toml")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def answer(i):
    return {"id": f"a-{i}", "messages": [{"role": "user", "content": f"Question {i}"}],
            "reasoning": "Let me add them. " * (1 + i % 5), "content": f"It is {2 * i}.", "finish_reason": "stop",
            "usage": {"completion_tokens": 1, "prompt_tokens": 1}}


async def main():
    recon = RunReconstructor(config, workers=1)
    await recon.start()
    for i in range(10):
        recon.submit("a", answer(i))
    await recon.wait_idle()
    # The disk fills: the next batch does not fit whole (the index, the largest file, takes ~400 bytes
    # an answer, so a few more).
    largest = max(f.stat().st_size for f in (root / "run" / "a" / "tokens").glob("*.*"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 1000, resource.RLIM_INFINITY))
    for i in range(10, 30):
        recon.submit("a", answer(i))
    await recon.wait_idle()
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await recon.close()
    p = recon.progress()
    print(orjson.dumps({"state": str(p.state), "done": p.done, "total": p.total, "message": p.message}).decode())

asyncio.run(main())
"""


def test_a_live_batch_the_disk_refuses_keeps_the_answers_that_fit(tmp_path):
    """A live run's batch is written whole (TokenWriter.append_batch); when the disk refuses it, its
    answers are written one by one as far as they fit: those are kept, the others are said lost (the stage
    stops, naming the file), and the token files hold whole answers only."""
    proc = subprocess.run([sys.executable, "-c", LIVE_BATCH_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = orjson.loads(proc.stdout.strip().splitlines()[-1])
    folder = tmp_path / "run" / "a" / "tokens"
    reader = TokenReader(folder)
    kept = [e.id for e in reader.entries]
    assert kept == [f"a-{i}" for i in range(len(kept))], kept  # the first batch, then a prefix of the second
    assert 10 < len(kept) < 30, kept
    assert result["done"] == len(kept) and result["total"] == 30, result
    assert result["state"] == "stopped" and str(folder) in result["message"] and "too large" in result["message"]
    total = sum(e.length for e in reader.entries)
    assert (folder / "input_ids.bin").stat().st_size == 4 * total
    assert (folder / "loss_mask.bin").stat().st_size == total


BUFFERED_WRITER_CHILD = r"""
import resource, signal, sys
import numpy as np
from pathlib import Path
from draftgen.core.errors import DiskError
from draftgen.core.tokens.store import TokenWriter

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
writer = TokenWriter(Path(sys.argv[1]), buffered=True)
for i in range(40):  # 40 x 300 ids = 48 KB: held in the buffer, past the limit
    writer.append(f"s{i}", np.arange(300, dtype=np.uint32), np.ones(300, dtype=np.uint8))
try:
    writer.close()
except DiskError as e:
    print("DiskError", e)
"""


def test_a_buffered_token_writer_fails_clearly_when_its_last_bytes_do_not_fit(tmp_path):
    folder = tmp_path / "tokens"
    proc = subprocess.run([sys.executable, "-c", BUFFERED_WRITER_CHILD, str(folder)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"DiskError cannot write {folder / 'input_ids.bin'}: the file is too large")


async def answered_run(tmp_path: Path, n: int = 60) -> tuple[Path, RunDir]:
    """A finished run (responses on disk) whose config reconstructs with the bundled tokenizer."""
    async with SimServer(SimConfig(seed=8, latency_scale=0.0, mean_completion_tokens=80), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 8}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                  "engine": {"reconstruct": False, "workers": 1}},
                          request={"temperature": 0.6, "include_reasoning": True})
        assert await Engine(cfg, TEST_KEY, seed=1).run() == snap.RunState.DONE
    return cfg.path, RunDir(cfg.run_dir)


@pytest.mark.slow
async def test_tokens_command_on_a_full_disk_fails_clearly_and_a_rerun_completes(tmp_path):
    config, run = await answered_run(tmp_path)
    responses = run.responses("a").read_bytes()
    proc = await asyncio.to_thread(cli, ["tokens", str(config)], 8_000)
    assert_clean_error(proc, f"cannot write {run.tokens('a')}", "the file is too large")
    assert run.responses("a").read_bytes() == responses
    proc = await asyncio.to_thread(cli, ["tokens", str(config)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = TokenReader(run.tokens("a"))
    assert sorted(e.id for e in reader.entries) == sorted(parsed_ids(run.responses("a")))
    assert all(e.meta["valid"] for e in reader.entries)
    # The samples committed before the failure and those after it sit end to end, nothing between.
    offsets = sorted((e.offset, e.length) for e in reader.entries)
    assert all(a + n == b for (a, n), (b, _) in zip(offsets, offsets[1:]))
    assert (run.tokens("a") / INDEX_FILE).read_bytes().endswith(b"\n")


@pytest.mark.slow
async def test_merge_on_a_full_disk_leaves_the_old_merged_set_intact(tmp_path):
    config, run = await answered_run(tmp_path)
    reconstruct_dataset(load_config(config), "a", workers=1)
    first = await asyncio.to_thread(cli, ["merge", str(config)])
    assert first.returncode == 0, first.stderr[-3000:]
    before = tree_digest(run.merged)
    assert "train.jsonl" in before and len(before) >= 4
    # A different seed: a merge that got through would change merged/.
    config.write_text(config.read_text() + "\n[merge]\nseed = 7\n")
    proc = await asyncio.to_thread(cli, ["merge", str(config)], 20_000)
    assert_clean_error(proc, f"cannot write {run.root}", "the file is too large")
    assert tree_digest(run.merged) == before
    assert not list(run.root.glob("merged.tmp-*")) and not list(run.root.glob("merged.old-*"))
    again = await asyncio.to_thread(cli, ["merge", str(config)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert tree_digest(run.merged) != before


EVENT_LOG_CHILD = r"""
import resource, signal, sys
from pathlib import Path
from draftgen.core.rundir import EventLog

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4_000, resource.RLIM_INFINITY))
log = EventLog(Path(sys.argv[1]))
for i in range(200):
    log.write("info", f"event {i}: " + "x" * 60)
log.close()
print("closed")
"""


def test_the_event_log_on_a_full_disk_never_takes_the_run_down(tmp_path):
    path = tmp_path / "events.log"
    proc = subprocess.run([sys.executable, "-c", EVENT_LOG_CHILD, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-3000:]
    assert 0 < path.stat().st_size <= 4_000


@pytest.mark.slow
def test_extraction_on_a_full_disk_keeps_every_finished_file(tmp_path):
    """A hidden-state file that cannot be written: a clear error naming it, the files already there
    untouched, no half file left; the next extraction writes only what is missing."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftgen.core.extract import extract
    from draftgen.core.tokens.store import TokenWriter

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                         max_position_embeddings=256, pad_token_id=0)).eval()
    model.save_pretrained(tmp_path / "model")
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    with TokenWriter(run / "merged" / "tokens") as writer:
        for k in range(10):
            length = int(rng.integers(40, 80))
            writer.append(f"s{k}", rng.integers(1, 499, size=length), rng.integers(0, 2, size=length))
    config = tmp_path / "draftgen.toml"
    config.write_text(f'[output]\ndir = "{run}"\n[[datasets]]\nname = "a"\nprompts = "p.jsonl"\n'
                      f'[extract]\nmodel = "{tmp_path / "model"}"\nbackend = "hf"\ndevice = "cpu"\n'
                      f'dtype = "float32"\n')
    assert extract(load_config(config)).written == 10
    files = sorted((run / "hidden_states").rglob("*.ckpt"))
    for gone in files[::3]:
        gone.unlink()
    kept = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.exists()}

    proc = cli(["extract", str(config)], limit=8_000, timeout=120)  # every file is ~30 KB
    assert_clean_error(proc, f"cannot write {run / 'hidden_states'}", ".ckpt: the file is too large")
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in kept} == kept
    # Besides the sample files: stats, merge.json, provenance.json, the training hand-off (.json, .sh).
    left = sorted(p for p in (run / "hidden_states").rglob("*")
                  if p.is_file() and p.suffix not in (".json", ".sh"))
    assert left == sorted(kept), "a half-written file was left behind"

    stats = extract(load_config(config))
    assert (stats.written, stats.skipped_existing) == (len(files) - len(kept), len(kept))
