"""The whole pipeline behind one control surface: smoke gate, generation, live reconstruction,
merge, extraction; snapshots and events published to a Hub for the TUI, headless line and attach.

`Pipeline` implements core/live/control.py `Controls`. The TUI embeds it on its own event loop; the
headless runner drives it with `asyncio.run`. It imports nothing from Textual.
"""

from __future__ import annotations

import asyncio
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.files import RunLock, exclusive
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.projection import Beside
from draftgen.core.generate.loop.run_state import PausedBy
from draftgen.core.live import snapshot as snap
from draftgen.core.live import stage_payloads as ev
from draftgen.core.live.control import Action
from draftgen.core.live.events import Payload
from draftgen.core.live.hub import Hub
from draftgen.core.live.summary import QuitEffects, quit_effects
from draftgen.core.live.timeline import TimelineRecorder, Totals
from draftgen.core.private_dir import check_private
from draftgen.core.records import ResponseLine, error_count
from draftgen.core.run import registry
from draftgen.core.run.events import EventPublisher
from draftgen.core.run.generation import GenerationStage
from draftgen.core.run.life import RunLife
from draftgen.core.run.stage_rows import StageRows
from draftgen.core.run.stages import Stages
from draftgen.core.run.startup import (
    Startup,
    smoke_status,  # noqa: F401 - its old home: tests and the CLI import it here
)
from draftgen.core.run.tokens_stage import TokensStage
from draftgen.core.rundir import EventLog, RunDir
from draftgen.core.secrets import Redactor


class Pipeline:
    """The run as the views see it: every stage (smoke, generation, tokens, merge, extract) driven from
    one place, the snapshot they read, and the control surface they call; the one-shot stages
    (smoke, merge, extract) run in core/run/stages.py."""

    read_only = False

    def __init__(self, config: Config, api_key: str, *, skip_smoke: bool = False,
                 reconstruct: bool | None = None, serve_attach: bool = True, seed: int | None = None) -> None:
        self.config = config
        # One of each per run, handed to every part that needs it.
        self.rundir = RunDir(config.run_dir)
        self._redact = Redactor(api_key, config.api.management_key())
        self.hub = Hub()
        self._api_key = api_key
        self.events = EventPublisher(self.hub, self._redact)
        # The tokens stage runs beside generation when its entry is on for the config, unless told.
        self._reconstruct = registry.stage("tokens").enabled(config) if reconstruct is None else reconstruct
        self._serve_attach = serve_attach
        self.engine = Engine(config, api_key, on_event=self.emit, on_answer=self._on_answer, seed=seed,
                             rundir=self.rundir, redact=self._redact)
        self.control = self.engine.control  # generation's state and how it ended (core/generate/loop/run_state.py)
        self._attach: Any = None
        self._metrics: Any = None  # core/live/metrics.py MetricsServer with [monitor] metrics
        self._run_lock: RunLock | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.stages = StageRows()  # the stages panel's rows: their one owner (core/run/stage_rows.py)
        self.oneshot = Stages(config, api_key, self.engine, self.stages, rundir=self.rundir, redact=self._redact,
                              emit=self.emit)
        self.tokens_stage = TokensStage(config, self.emit, self.stages, self.rundir)
        self.startup = Startup(config, api_key, self.oneshot, self.emit, rundir=self.rundir, redact=self._redact,
                               skip_smoke=skip_smoke, reconstruct=self._reconstruct)
        self.life = RunLife(self.control, self.stages, self._redact)  # how the run ends: its one owner
        self.generation = GenerationStage(
            config, self.engine, self.startup, self.tokens_stage, self.oneshot, self.life, self.emit,
            publish=self.publish, reconstruct=self._reconstruct)
        self.timeline = TimelineRecorder(self.rundir.history, on_write_error=lambda path, cause: self.emit(
            ev.History(path=path, cause=cause)))

    @property
    def quit_requested(self) -> asyncio.Event:
        """Set once a quit is asked for (drain or stop now)."""
        return self.startup.quit_requested

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        # Not a directory other users can write, unless shared on purpose (core/private_dir.py check_private).
        check_private(self.rundir.root, self.config.path, shared=self.config.output.shared)
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        # The run directory is live from here until close() (core/files.py `exclusive`).
        self._run_lock = exclusive(self.rundir.root, "draftgen run").acquire()
        try:
            await self._start()
        except BaseException:
            await self._close_metrics()
            self._run_lock.release()  # not started: another run or command may use the directory
            self._run_lock = None
            raise

    async def _start(self) -> None:
        self.events.open_log(EventLog(self.rundir.events_log))
        await asyncio.to_thread(self.timeline.load)
        self.timeline.start(self._totals())
        await self._serve_metrics()
        if self._serve_attach:
            from draftgen.core.live.attach import AttachServer
            self._attach = AttachServer(self.hub, self.rundir.socket, on_warning=lambda message: self.emit(
                ev.Attach(detail=message)))
            await self._attach.start()
        self._ticker = asyncio.create_task(self._publish_loop())
        self.publish()

    async def close(self) -> None:
        self.events.flush_repeats()
        self.oneshot.cancel()
        await self.tokens_stage.close()
        if self._ticker is not None:
            self._ticker.cancel()
        self.publish()
        if self._attach is not None:
            await self._attach.close()
            self._attach = None
        await self._close_metrics()
        self.events.close()
        self.timeline.close()
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    async def _serve_metrics(self) -> None:
        """[monitor] metrics: /metrics served from the hub's latest snapshot (docs/metrics.md), bound here,
        before any request is sent: a port in use stops the run with the key named."""
        address = self.config.monitor.metrics_address()
        if address is None:
            return
        from draftgen.core.live.metrics import MetricsServer
        server = MetricsServer(lambda: self.hub.latest, *address, where=str(self.config.path))
        await server.start()
        self._metrics = server
        self.emit(ev.Metrics(url=server.url))

    async def _close_metrics(self) -> None:
        if self._metrics is not None:
            await self._metrics.close()
            self._metrics = None

    @property
    def exit_code(self) -> int:
        """The run's exit code (docs/run-end.md), decided by its one owner (core/run/life.py)."""
        return self.life.exit_code

    @property
    def error(self) -> DraftgenError | None:
        """The user-facing error that stopped the run, for the command boundary to print."""
        return self.life.error

    async def generate(self) -> str:
        """Smoke gate, then the run (core/run/generation.py). Returns the engine's final state."""
        return await self.generation.run()

    # -- events and snapshots -------------------------------------------------------------------

    def emit(self, payload: Payload, /) -> None:
        self.events.emit(payload)

    def _flush_repeats(self) -> None:
        self.events.flush_repeats()

    def snapshot(self) -> snap.RunSnapshot:
        """The run's picture, made once by the engine's projector (core/generate/loop/projection.py) from
        its owners' views and what the pipeline's own owners add beside them."""
        self.tokens_stage.refresh()
        # The run never opened its ledger: what was spent (the smoke test's requests) is on spend.jsonl.
        smoke_spent = self.startup.spent if not self.life.launched else None
        life = self.life.now()  # the stages and how the run stands, decided by its one owner (core/run/life.py)
        return self.engine.snapshot(Beside(
            generation=life.generation, stages=life.stages, label=life.label, finished=life.finished,
            gpus=self.oneshot.gpus,
            fidelity=self.tokens_stage.fidelity, timeline=self.timeline.timeline(), started_at=self.timeline.started_at,
            first_started_at=self.timeline.first_started_at, smoke_spent=smoke_spent))

    def _totals(self) -> Totals:
        """This process's running totals for the history (core/live/timeline.py)."""
        e = self.engine
        errors = error_count(e.errors.items())
        return Totals(answers=e.book.rates.answers, tokens=e.book.rates.tokens, usd=e.money.spent_run,
                      errors=errors, in_flight=e.in_flight)

    def publish(self) -> None:
        self.hub.publish_snapshot(self.snapshot())

    async def _publish_loop(self) -> None:
        period = 1.0 / self.config.engine.snapshot_hz
        while True:
            await asyncio.sleep(period)
            self.timeline.observe(self._totals())
            self.publish()

    def _on_answer(self, dataset: str, record: ResponseLine) -> None:
        self.tokens_stage.submit(dataset, record)

    # -- control surface (core/live/control.py) ------------------------------------------------------

    def unavailable(self, action: Action | str) -> str | None:
        state = self.engine.state
        if action == Action.PAUSE:
            return None if state == snap.RunState.RUNNING else f"nothing to pause: the run is {state.lower()}"
        if action == Action.RESUME:
            return None if state == snap.RunState.PAUSED else f"nothing to resume: the run is {state.lower()}"
        if self.oneshot.running(action):
            return f"{action} is already running"
        return registry.stage(action).unavailable(self)

    def pause(self) -> None:
        self.engine.pause(PausedBy.USER)

    def resume(self) -> None:
        self.engine.resume()

    async def smoke(self) -> bool:
        return await self.oneshot.smoke()

    async def run_stage(self, name: str, **options: Any) -> Any:
        """Run a stage of the registry in the foreground (stop now cancels it: None)."""
        return await self.oneshot.run(name, registry.stage(name).run(self, **options))

    def start_stage(self, name: str, **options: Any) -> None:
        """Start a stage of the registry in the background: its progress is its row, its end an event."""
        self.oneshot.spawn(name, registry.stage(name).run(self, **options))

    async def merge(self) -> Any:
        """Merge in the foreground (stop now cancels it: None)."""
        return await self.run_stage("merge")

    async def extract(self, shard: tuple[int, int] = (0, 1)) -> Any:
        """Extract in the foreground (stop now ends it after its batch, stopped)."""
        return await self.run_stage("extract", shard=shard)

    def run_smoke(self) -> None:
        self.start_stage("smoke")

    def start_merge(self, replace_hidden_states: bool = False) -> None:
        self.start_stage("merge", replace_hidden_states=replace_hidden_states)

    def start_extract(self, on_other_merge: str = "refuse") -> None:
        self.start_stage("extract", on_other_merge=on_other_merge)

    def merge_question(self) -> str | None:
        from draftgen.core.extract.claim import merge_question
        return merge_question(self.rundir.root)

    def extract_question(self) -> str | None:
        from draftgen.core.extract.claim import extract_question
        return extract_question(self.rundir.root)

    def spool_held(self) -> None:
        """Do not wait for the disk: the answers held in memory are spooled (spool.py) as the run ends."""
        self.engine.spool_held()

    def quit_effects(self) -> QuitEffects:
        """What drain and stop now do to the stage running now (the quit dialog, headless SIGINT)."""
        return quit_effects(self.snapshot())

    def quit_asked(self, asking: bool) -> None:
        """The quit dialog is open (or closed again): a run not started yet waits for its answer."""
        self.startup.dialog(asking)

    def quit(self, drain: bool) -> None:
        self.startup.quit(drain)
        if not drain:
            self.oneshot.cancel()  # the extraction thread stops after its current batch
        if not self.life.launched:
            return  # nothing to drain or stop yet: the run will not start (core/run/pipeline.py _generate)
        if drain:
            self.engine.drain()
        else:
            self.engine.stop()
