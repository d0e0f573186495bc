"""How a run ends when it is quit, through the real entry points: `run_tui` driven by Textual's pilot,
and `draftgen run --headless` in a subprocess with real signals. Stages (smoke, generation, tokens,
merge, extract) have typed states that the header, the quit dialog, the summary and the exit code
read: a quit during the start-up smoke test sends no run request, a stage stopped before its end is
said as stopped with the command that finishes it (exit 3), and DONE waits for every started stage.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from draftgen.core.extract import runner
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.snapshot import RunState
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.core.units import usd
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui.app import DraftgenApp
from draftgen.tui.launch import run_tui
from draftgen.tui.screens.quitdialog import QuitScreen
from tests import helpers
from tests.extract.test_extract_writer import HIDDEN, N_LAYERS, FakeBackend
from tests.helpers import TEST_KEY, chat_body, chat_post, cli_env, make_config, text, until

TOKENIZER = {"path": str(bundled_kimi_path())}


def sent_lines(rd: RunDir) -> list[dict]:
    """The spend ledger's "sent" lines: one per request that left."""
    lines = [orjson.loads(x) for x in rd.spend.read_bytes().splitlines() if x.strip()] if rd.spend.exists() else []
    return [x for x in lines if x.get("e") == "sent"]


def stage_is(app: DraftgenApp, name: str, state: str) -> bool:
    """The app's newest snapshot has stage `name` in `state`."""
    st = app.latest.stage(name) if app.latest is not None else None
    return st is not None and st.state == state


# -- the start-up smoke test -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["d", "s"], ids=["drain", "stop-now"])
async def test_tui_quit_during_the_smoke_test_sends_no_run_request(tmp_path: Path, choice: str) -> None:
    """q while the start-up smoke test's request is in the air: the dialog says the smoke test runs and
    what d and s do to it; the run waits for the answer, and neither choice sends a run request.
    The server holds the smoke request until a second request is in flight (one of the test's own, sent once
    the dialog has been read), so on a loaded machine the answer cannot land before the header and the
    dialog are seen."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.2, mean_completion_tokens=60, hold_until_in_flight=2),
                         port=0) as sim, aiohttp.ClientSession() as session:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 8}],
                          tables={"tokenizer": TOKENIZER, "engine": {"reconstruct": False}})
        seen: dict[str, str] = {}
        released: list[asyncio.Task[Any]] = []  # the test's own request that releases the held smoke request

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                await until(lambda: sim.stats.in_flight == 1, "the smoke request in the air")
                await until(lambda: stage_is(app, "smoke", "running"), "the smoke stage running in a snapshot")
                await pilot.pause(0.1)
                seen["header"] = text(app, "#header")
                await pilot.press("q")
                assert isinstance(app.screen, QuitScreen)
                seen["dialog"] = " ".join(text(app, "#quit-text").split()).lower()
                released.append(asyncio.create_task(chat_post(session, sim, chat_body())))
                if choice == "s":
                    # The dialog left open while the smoke request ends: the run still waits for the answer.
                    await until(lambda: sim.stats.in_flight == 0 and stage_is(app, "smoke", "done"),
                                "the smoke test passed")
                    await pilot.pause(0.3)
                    assert sim.stats.requests_total == 2, "the run started sending behind the quit dialog"
                await pilot.press(choice)
                await until(lambda: not app.is_running, "the app exited", timeout=60)

        out = io.StringIO()
        code = await asyncio.wait_for(run_tui(cfg, TEST_KEY, out=out, run_app=drive), 120)
        await asyncio.gather(*released)
        requests = sim.stats.requests_total - len(released)
    summary = out.getvalue()
    assert "SMOKE TEST" in seen["header"], seen["header"]
    assert "smoke test is running" in seen["dialog"] and "the run does not start" in seen["dialog"], seen["dialog"]
    assert "0 requests are in flight" not in seen["dialog"]
    assert requests == 1, "a run request was sent after a quit asked for during the smoke test"
    rd = RunDir(cfg.run_dir)
    assert [x["ds"] for x in sent_lines(rd)] == ["(smoke)"]  # the smoke request stays on the ledger
    assert not rd.responses("a").exists()
    assert code == 130, summary
    assert "exit 130 (interrupted before the run started)" in summary
    assert "generation: skipped: the run did not start" in summary, summary


@pytest.mark.slow
async def test_tui_smoke_test_mid_run_says_who_paused_and_resumes(tmp_path: Path) -> None:
    """s while the run sends: the run pauses for the smoke test and the snapshot says so (who paused,
    and a waiting line that does not offer r, which would send behind the smoke test); it resumes at
    its end, and the pause is gone from the snapshot."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=1.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 400, "concurrency": 4}],
                          tables={"tokenizer": TOKENIZER, "engine": {"reconstruct": False}})
        seen: dict[str, str] = {}

        def paused_for_smoke(app: DraftgenApp) -> bool:
            s = app.latest
            return s is not None and s.state == RunState.PAUSED and s.paused_by == "for the smoke test"

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                await until(lambda: app.latest is not None and app.latest.state == RunState.RUNNING
                            and sim.stats.requests_total > 1, "the run sending", timeout=60)
                await pilot.press("s")
                await until(lambda: paused_for_smoke(app), "paused for the smoke test in a snapshot")
                seen["waiting"] = app.latest.waiting
                await pilot.press("escape")  # the smoke screen closed: the alert bar under the header
                await until(lambda: paused_for_smoke(app) and "smoke" in text(app, "#alert"), "the alert bar")
                seen["alert"] = " ".join(text(app, "#alert").split())
                await until(lambda: stage_is(app, "smoke", "done") and app.latest.state == RunState.RUNNING,
                            "the run resumed after the smoke test", timeout=60)
                seen["after"] = app.latest.paused_by
                await pilot.press("q")
                await pilot.press("s")
                await until(lambda: not app.is_running, "the app exited", timeout=60)

        await asyncio.wait_for(run_tui(cfg, TEST_KEY, out=io.StringIO(), run_app=drive, skip_smoke=True), 120)
    assert seen["waiting"] == "paused for the smoke test: the run resumes when it ends", seen["waiting"]
    assert "paused for the smoke test" in seen["alert"] and "r resumes" not in seen["alert"], seen["alert"]
    assert seen["after"] == ""


@pytest.mark.slow
async def test_headless_ctrl_c_twice_during_the_smoke_test_ends_at_once_with_130(tmp_path: Path) -> None:
    """The smoke request hangs: the first SIGINT says the smoke test runs and what a second one does,
    the second ends the process (no DRAINING status lines), exit 130, and the spent figure is the
    ledger's (the abandoned smoke request at its reservation)."""
    async with SimServer(SimConfig(seed=3, fixed_latency_s=600.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 8}],
                          tables={"tokenizer": TOKENIZER, "engine": {"reconstruct": False},
                                  "api": {"request_timeout_s": 900}})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--interval", "0.2",
            env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        lines: list[str] = []

        async def read_until(needle: str) -> None:
            await helpers.read_until(proc, lines, needle)

        try:
            await read_until("running the smoke test first")
            await until(lambda: sim.stats.in_flight == 1, "the smoke request in the air")
            await read_until("SMOKE TEST")  # the status line says which stage runs
            proc.send_signal(signal.SIGINT)
            await read_until("press Ctrl-C again")
            proc.send_signal(signal.SIGINT)
            rest, _ = await asyncio.wait_for(proc.communicate(), 30)  # a hang guard: the smoke request hangs 600 s
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        requests = sim.stats.requests_total
    out = "".join(lines) + rest.decode()
    assert "smoke test is running" in out and "SIGINT again: stopping now" in out, out[-3000:]
    assert "DRAINING" not in out, out[-3000:]
    assert proc.returncode == 130, out[-3000:]
    rd = RunDir(cfg.run_dir)
    assert requests == 1 and [x["ds"] for x in sent_lines(rd)] == ["(smoke)"]
    spent = SpendLedger.read(rd.spend).spent_usd
    assert spent > 0
    assert f"spent {usd(spent)}" in out, out[-2000:]
    assert "Traceback" not in out


# -- extraction --------------------------------------------------------------------------------------


class GatedBackend(FakeBackend):
    """The model stand-in: each batch waits for a permit, so the test holds extraction mid-way."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.batches = 0

    def run(self, batch):  # noqa: ANN001, ANN201 - FakeBackend's signature
        if not self.permits.acquire(timeout=60):
            raise AssertionError("the test never let this batch run")
        self.batches += 1
        return super().run(batch)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["d", "s", "end"], ids=["drain", "stop-now", "ends-while-asked"])
async def test_tui_quit_during_extraction_drains_it_whole_or_says_it_stopped(tmp_path: Path, monkeypatch,
                                                                             choice: str) -> None:
    """Generation done, merge done, extraction running (the demo's chain): the header says EXTRACTING,
    not DONE; the dialog says extraction runs and what d and s do. Drain: every file is written,
    exit 0. Stop now: extraction stops after its batch, said as stopped with its counts and
    `draftgen extract`, exit 3 (incomplete), never "extraction done". Ends while asked: extraction
    finishes with the question open, which then says the run has ended and nothing is running; d exits 0."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "num_hidden_layers": N_LAYERS}))
    backend = GatedBackend()
    monkeypatch.setattr(runner, "make_backend", lambda *a, **kw: backend)
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4}],
                          tables={"tokenizer": TOKENIZER, "engine": {"reconstruct": True, "workers": 1},
                                  "extract": {"model": str(model), "backend": "hf", "device": "cpu",
                                              "batch_tokens": 1}})
        seen: dict[str, str] = {}

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                await until(lambda: stage_is(app, "extract", "running"), "extraction running", timeout=120)
                backend.permits.release(3)
                hidden = RunDir(cfg.run_dir).hidden_states
                await until(lambda: len(list(hidden.rglob("data_*.ckpt"))) >= 3, "3 files written")
                await pilot.pause(0.2)
                seen["header"] = text(app, "#header")
                await pilot.press("q")
                assert isinstance(app.screen, QuitScreen)
                seen["dialog"] = " ".join(text(app, "#quit-text").split()).lower()
                if choice == "end":  # no key yet: the run finishes under the open question
                    backend.permits.release(1000)
                    await until(lambda: "has ended" in text(app, "#quit-text"), "the question follows the run",
                                timeout=60)
                    seen["ended"] = " ".join(text(app, "#quit-text").split())
                await pilot.press("d" if choice == "end" else choice)
                if choice == "d":
                    await pilot.pause(0.3)
                    assert app.is_running, "a drain must wait for the extraction, not cut it short"
                backend.permits.release(1000)
                await until(lambda: not app.is_running, "the app exited", timeout=60)

        out = io.StringIO()
        code = await asyncio.wait_for(run_tui(cfg, TEST_KEY, skip_smoke=True, after_run=["merge", "extract"],
                                              out=out, run_app=drive), 180)
    summary = out.getvalue()
    n = len(TokenReader(RunDir(cfg.run_dir).merged / "tokens"))  # what merge kept
    assert n > 3
    assert "EXTRACTING" in seen["header"] and "DONE" not in seen["header"], seen["header"]
    assert "extraction is running" in seen["dialog"] and "draftgen extract" in seen["dialog"], seen["dialog"]
    files = list((RunDir(cfg.run_dir).hidden_states).rglob("data_*.ckpt"))
    events = RunDir(cfg.run_dir).events_log.read_text()
    if choice == "end":
        assert "The run has ended (DONE) and nothing is running" in seen["ended"], seen["ended"]
    if choice in ("d", "end"):
        assert code == 0, summary
        assert len(files) == n
        assert "extraction done" in events
    else:
        assert code == 3, summary
        assert 3 <= len(files) < n
        assert "extraction done" not in events and "extraction STOPPED" in events
        assert f"extract: stopped at {len(files)} of {n}" in summary, summary
        assert f"`draftgen extract {cfg.path}` finishes it" in " ".join(summary.split()), summary
        assert "STOPPED" in summary.splitlines()[0] and "exit 3 (incomplete" in summary


# -- --debug ------------------------------------------------------------------------------------------


SITECUSTOMIZE = '''
# Written by tests/run/test_lifecycle.py: a bug inside the run (not a user error), raised from a named frame.
import draftgen.core.generate.commands.precheck as precheck

def broken_check_inputs(*args, **kwargs):
    raise RuntimeError("a bug the test put here")

precheck.check_inputs = broken_check_inputs
'''


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_debug_prints_the_internal_errors_own_traceback(tmp_path: Path, debug: bool) -> None:
    import subprocess
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 3}])
    env = cli_env(PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "draftgen.cli.main", *(["--debug"] if debug else []), "run",
                           str(cfg.path), "--headless", "--skip-smoke"], env=env, capture_output=True, text=True,
                          timeout=120)
    err = proc.stderr
    assert proc.returncode != 0
    assert "internal error: RuntimeError: a bug the test put here" in err + proc.stdout, err[-3000:]
    if debug:
        assert "Traceback" in err and "in broken_check_inputs" in err, err[-3000:]
    else:
        assert "Traceback" not in err, err[-3000:]
