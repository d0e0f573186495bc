"""The generation stage as the pipeline runs it: the start-up gate (startup.py), the engine's run, the
tokens stage after it (tokens_stage.py). What it sees is told to the run's one owner, `RunLife`
(life.py): the run launched (run requests may have been sent), the smoke test failed, quit before the
start, the failure that stopped it, the tokens stage's report; RunLife decides from these and from
how generation ended (the engine's RunControl) the stage's state, the label and the exit code
(docs/run-end.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.live import stage_payloads as ev
from draftgen.core.live.events import EventSink, Level
from draftgen.core.quoting import sh_path
from draftgen.core.run.life import RunLife
from draftgen.core.run.stages import Stages
from draftgen.core.run.startup import Startup, StartVerdict
from draftgen.core.run.tokens_stage import TokensStage


class GenerationStage:
    """Smoke gate, then the run, then the tokens stage's report; what it sees, told to RunLife."""

    def __init__(self, config: Config, engine: Engine, startup: Startup, tokens_stage: TokensStage, oneshot: Stages,
                 life: RunLife, emit: EventSink, *, publish: Callable[[], None], reconstruct: bool) -> None:
        self._config = config
        self._engine = engine
        self._control = engine.control  # generation's state and how it ended, as the engine reports it
        self._startup = startup
        self._tokens_stage = tokens_stage
        self._oneshot = oneshot
        self._life = life  # the run's one owner: told what happens, decides how the run ends
        self._emit = emit
        self._publish = publish
        self._reconstruct = reconstruct

    async def run(self) -> str:
        """Smoke gate, then the run. Returns the engine's final state. A user-facing error (a missing
        tokenizer or prompt file, the open-file limit) stops the run with an alert and is kept in
        `RunLife.error` for the command boundary to print."""
        try:
            return await self._generate()
        except Exception as e:  # noqa: BLE001 - the run must never sit silent: every failure shows
            if not isinstance(e, DraftgenError):
                # A bug, not a user error: its traceback travels as the cause (--debug prints it).
                wrapper = DraftgenError(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the "
                                        "traceback, and please report it)")
                wrapper.__cause__ = e
                e = wrapper
            self._life.fail(e)
            self._emit(ev.RunFailed(cause=str(e)))
            return snap.RunState.STOPPED

    async def _generate(self) -> str:
        try:
            gated = await self._startup.gate()
            if gated.verdict is StartVerdict.NOT_STARTED:
                return self._not_started(gated.why)
            if gated.verdict is StartVerdict.SMOKE_FAILED:
                # Read in the TUI, the headless log and the shell after the TUI closes: a command, not a key.
                self._life.smoke_failed("the smoke test failed: the run will not start at full concurrency "
                                        f"(fix what it names, then `draftgen smoke {sh_path(self._config.path)}`; "
                                        "or --skip-smoke)")
                return snap.RunState.STOPPED
            if self._reconstruct:
                await self._tokens_stage.start()
            state = await self._run_engine()
            if not self._life.launched:
                return self._not_started("quit before the run started")
            complete = await self._tokens_stage.finish(imported=self._control.held_outcome.imported > 0)
            self._life.ended(tokens_complete=complete)
            return state
        finally:
            self._publish()

    def _not_started(self, why: str) -> str:
        """Quit before the run started: no run request was sent; exit 130 (docs/run-end.md)."""
        self._life.not_started()
        self._emit(ev.RunDone(not_started=why, config=sh_path(self._config.path), at=Level.WARN))
        return snap.RunState.STOPPED

    async def _run_engine(self) -> snap.RunState:
        """The engine's run, its spend ledger opened while no smoke test runs (one writer at a time: a
        smoke test started with s first finishes, on its own ledger; one started after books on the
        run's, core/run/stages.py)."""
        async with self._oneshot.smoke_lock:
            if self._startup.quit_requested.is_set():  # quit while a smoke test ran: nothing is started
                return snap.RunState.STOPPED
            self._life.launch()
            run = asyncio.create_task(self._engine.run())
            while not (self._engine.spend.is_open or run.done()):
                await asyncio.sleep(0.02)
        return await run
