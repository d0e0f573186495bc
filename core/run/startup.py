"""What happens before the run's first request: the inputs checked, the API reached, the smoke gate
(the smoke test run first when smoke.json does not show a pass for this config's request shapes),
and the quit dialog answered. A quit here means the run does not start and no run request is sent
(core/run/pipeline.py turns that into exit 130).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import orjson

from draftgen.core.config import Config
from draftgen.core.errors import UnreachableError
from draftgen.core.generate.commands.smoke_account import SMOKE_RETRY_S
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventSink, Level
from draftgen.core.live.stage_payloads import QuitDialog, Smoke
from draftgen.core.run.stages import Stages
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor


def smoke_status(config: Config, rundir: RunDir | None = None) -> tuple[bool, str]:
    """(passed for this config's request shapes, why not) from smoke.json (of `rundir`, the run's, if given)."""
    path = (rundir or RunDir(config.run_dir)).smoke_json
    if not path.exists():
        return False, "no smoke test has run for this run directory"
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False, f"{path} cannot be read"
    if data.get("fingerprint") != config.run_fingerprint():
        return False, "the request parameters changed since the last smoke test"
    if not data.get("passed"):
        return False, "the last smoke test failed"
    return True, ""


class StartVerdict(Enum):
    START = "start"               # the run may start
    SMOKE_FAILED = "smoke_failed"  # the start-up smoke test failed: the run does not start
    NOT_STARTED = "not_started"    # quit (or the smoke test stopped) before the run started


@dataclass(frozen=True)
class Gated:
    verdict: StartVerdict
    why: str = ""


class Startup:
    """The gate in front of the run, and the quit asked for while it is closed."""

    def __init__(self, config: Config, api_key: str, oneshot: Stages, emit: EventSink, *, rundir: RunDir,
                 redact: Redactor, skip_smoke: bool, reconstruct: bool) -> None:
        self._config = config
        self._rundir = rundir  # the run's, and its redactor (one each per run: core/run/pipeline.py)
        self._redact = redact
        self._api_key = api_key
        self._oneshot = oneshot
        self._emit = emit
        self._skip_smoke = skip_smoke
        self._reconstruct = reconstruct
        self.quit_requested = asyncio.Event()
        self._reading_stop = threading.Event()  # a quit stops the prompt files' count (prompt_files.py ReadingStopped)
        self._no_dialog = asyncio.Event()  # cleared while the quit dialog is open: the run does not start
        self._no_dialog.set()
        self._smoke: asyncio.Future[bool] | None = None  # the start-up smoke test (stop now cancels it)
        self.spent: tuple[float, float] | None = None  # (before, after) the smoke test, from spend.jsonl

    async def gate(self) -> Gated:
        """Check what can be checked for free, run the smoke test if one is needed, wait for the quit
        dialog; say whether the run may start."""
        from draftgen.core.generate.api.preflight import check_api
        from draftgen.core.generate.commands.precheck import check_inputs
        from draftgen.core.generate.loop.prompt_files import ReadingStopped
        cfg = self._config
        # Prompt files and the tokenizer before anything is paid for (the smoke test included).
        try:
            await asyncio.to_thread(check_inputs, cfg, tokenizer=self._reconstruct, stop=self._reading_stop)
        except ReadingStopped:
            return Gated(StartVerdict.NOT_STARTED, "quit before the run started")
        ok, why = (True, "") if self._skip_smoke else smoke_status(cfg, self._rundir)
        try:
            await check_api(cfg, self._api_key, self._redact)
        except UnreachableError as e:
            # What happens next depends on the smoke gate: say that, not a wait that never comes.
            self._emit(ev.Unreachable(cause=str(e), at_start=True, smoke_retry_s=0.0 if ok else SMOKE_RETRY_S))
        if warning := cfg.kind_warning():  # the server's kind is known from here
            self._emit(ev.RequestKeys(detail=warning, at=Level.WARN))
        if not self._skip_smoke and not ok and not self.quit_requested.is_set():
            self._emit(Smoke(why=why))
            spend = self._rundir.spend
            before = await asyncio.to_thread(_spent_on_disk, spend)
            self._smoke = asyncio.ensure_future(self._oneshot.smoke())
            await asyncio.wait({self._smoke})
            # The run's ledger is not open: the summary's spend is read from the file (the smoke request in it).
            self.spent = (before, await asyncio.to_thread(_spent_on_disk, spend))
            if self._smoke.cancelled():
                return Gated(StartVerdict.NOT_STARTED, "the smoke test was stopped before it finished")
            if not self._smoke.result():
                return Gated(StartVerdict.SMOKE_FAILED)
        if self.quit_requested.is_set() or not self._no_dialog.is_set():
            if not self._no_dialog.is_set():
                self._emit(QuitDialog())
                await self._no_dialog.wait()
            if self.quit_requested.is_set():
                return Gated(StartVerdict.NOT_STARTED, "quit before the run started")
        return Gated(StartVerdict.START)

    def dialog(self, asking: bool) -> None:
        """The quit dialog is open (or closed again): a run not started yet waits for its answer."""
        if asking:
            self._no_dialog.clear()
        else:
            self._no_dialog.set()

    def quit(self, drain: bool) -> None:
        self.quit_requested.set()
        self._reading_stop.set()
        self._no_dialog.set()
        if not drain and self._smoke is not None:
            self._smoke.cancel()  # the start-up smoke test: its request is abandoned, on the ledger


def _spent_on_disk(path: Path) -> float:
    return SpendLedger.read(path).spent_usd if path.exists() else 0.0
