"""The generation stage as the pipeline runs it: the start-up gate (startup.py), the engine's run, the
tokens stage after it (live_tokens.py), and how it ended: its stage state, the error that stopped it,
and the exit code (docs/run-end.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from draftgen.core.config import Config
from draftgen.core.errors import EXIT_KEY_REFUSED, DraftgenError
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.live.summary import (
    EXIT_COMPLETE,
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_SMOKE_FAILED,
    INCOMPLETE,
)
from draftgen.core.run.live_tokens import LiveTokens
from draftgen.core.run.stages import Stages
from draftgen.core.run.startup import Startup, Verdict
from draftgen.core.secrets import Redactor


class Generation:
    """Smoke gate, then the run, then the tokens stage's report; the stage's state and exit code."""

    def __init__(self, config: Config, engine: Engine, startup: Startup, tokens: LiveTokens, oneshot: Stages,
                 emit: snap.EventSink, redact: Redactor, *, publish: Callable[[], None], reconstruct: bool) -> None:
        self._config = config
        self._engine = engine
        self._startup = startup
        self._tokens = tokens
        self._oneshot = oneshot
        self._stages = oneshot.progress
        self._emit = emit
        self._redact = redact
        self._publish = publish
        self._reconstruct = reconstruct
        self.state = snap.StageState.IDLE
        self.started = False   # the engine's run was started: run requests may have been sent
        self.error: DraftgenError | None = None
        self._code = EXIT_COMPLETE

    @property
    def exit_code(self) -> int:
        """The run's exit code (docs/run-end.md): a stage stopped before its end is incomplete (3),
        a stage that failed an error (2), never complete."""
        code = self._code
        if code == EXIT_COMPLETE:
            states = {self._stages[n].state for n in self._stages if n != "smoke"}
            if snap.StageState.FAILED in states:
                return EXIT_ERROR
            if snap.StageState.STOPPED in states:
                return EXIT_INCOMPLETE
        return code

    async def run(self) -> str:
        """Smoke gate, then the run. Returns the engine's final state. A user-facing error (a missing
        tokenizer or prompt file, the open-file limit) stops the run with an alert and is kept in
        `self.error` for the command boundary to print."""
        try:
            return await self._generate()
        except Exception as e:  # noqa: BLE001 - the run must never sit silent: every failure shows
            if not isinstance(e, DraftgenError):
                # A bug, not a user error: its traceback travels as the cause (--debug prints it).
                wrapper = DraftgenError(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the "
                                        "traceback, and please report it)")
                wrapper.__cause__ = e
                e = wrapper
            self.error = e
            self.state = snap.StageState.FAILED if self.started else snap.StageState.SKIPPED
            self._code = e.exit_code
            for name, stage in list(self._stages.items()):
                if stage.state == snap.StageState.RUNNING:
                    self._stages[name] = dataclasses.replace(stage, state=snap.StageState.FAILED,
                                                             message=self._redact(str(e)))
            self._engine.control.fail(self._redact(str(e)))
            self._emit(snap.Level.ERROR, snap.EventKind.RUN_FAILED, f"the run cannot go on: {e}")
            return snap.RunState.STOPPED

    async def _generate(self) -> str:
        try:
            gated = await self._startup.gate()
            if gated.verdict is Verdict.NOT_STARTED:
                return self._not_started(gated.why)
            if gated.verdict is Verdict.SMOKE_FAILED:
                # Read in the TUI, the headless log and the shell after the TUI closes: a command, not a key.
                self._engine.control.fail("the smoke test failed: the run will not start at full concurrency "
                                          f"(fix what it names, then `draftgen smoke {self._config.path}`; "
                                          "or --skip-smoke)")
                self.state = snap.StageState.SKIPPED
                self._code = EXIT_SMOKE_FAILED
                return snap.RunState.STOPPED
            if self._reconstruct:
                await self._tokens.start()
            state = await self._run_engine()
            if not self.started:
                return self._not_started("quit before the run started")
            self.state = (snap.StageState.DONE if state in (snap.RunState.DONE, snap.RunState.LIMITED)
                          else snap.StageState.STOPPED)
            held = self._engine.book.held_outcome
            if (state in INCOMPLETE or held.spooled or held.spooled_failures) and self._code == EXIT_COMPLETE:
                # Prompts are left, or records wait in a spool for the next run: the shell can tell it apart.
                self._code = EXIT_INCOMPLETE
            if self._engine.key_refused is not None:
                self._code = EXIT_KEY_REFUSED
            if not await self._tokens.finish(imported=held.imported > 0) and self._code == EXIT_COMPLETE:
                self._code = EXIT_ERROR
            return state
        finally:
            self._publish()

    def _not_started(self, why: str) -> str:
        """Quit before the run started: no run request was sent; exit 130 (docs/run-end.md)."""
        self._engine.control.end(snap.RunState.STOPPED)
        self.state = snap.StageState.SKIPPED
        self._code = EXIT_INTERRUPTED
        self._emit(snap.Level.WARN, snap.EventKind.RUN_DONE, f"{why}: no run request was sent; "
                   f"`draftgen run {self._config.path}` starts it")
        return snap.RunState.STOPPED

    async def _run_engine(self) -> str:
        """The engine's run, its spend ledger opened while no smoke test runs (one writer at a time: a
        smoke test started with s first finishes, on its own ledger; one started after books on the
        run's, core/run/stages.py)."""
        async with self._oneshot.smoke_lock:
            if self._startup.quit_requested.is_set():  # quit while a smoke test ran: nothing is started
                return snap.RunState.STOPPED
            self.started = True
            self.state = snap.StageState.RUNNING
            run = asyncio.create_task(self._engine.run())
            while not (self._engine.spend.is_open or run.done()):
                await asyncio.sleep(0.02)
        return await run
