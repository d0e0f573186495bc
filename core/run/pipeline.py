"""The whole pipeline behind one control surface: smoke gate, generation, live reconstruction,
merge, extraction; snapshots and events published to a Hub for the TUI, headless line and attach.

`Pipeline` implements core/live/control.py `Controls`. The TUI embeds it on its own event loop; the
headless runner drives it with `asyncio.run`. It imports nothing from Textual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson

from draftgen.core.live import snapshot as snap
from draftgen.core.config import Config
from draftgen.core.generate.engine import Engine
from draftgen.core.generate.smoke import SMOKE_RETRY_S
from draftgen.core.errors import EXIT_KEY_REFUSED, DraftgenError, UnreachableError
from draftgen.core.files import RunLock, exclusive
from draftgen.core.live.hub import Hub
from draftgen.core.generate.spend import SpendLedger
from draftgen.core.live.summary import (EXIT_COMPLETE, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_INTERRUPTED, INCOMPLETE,
                                        QuitEffects, quit_effects)
from draftgen.core.run.stages import Stages
from draftgen.core.live.timeline import TimelineRecorder, Totals
from draftgen.core.records import error_count
from draftgen.core.rundir import EventLog, RunDir
from draftgen.core.secrets import Redactor

STAGES = ("smoke", "tokens", "merge", "extract")  # the stages panel's rows (generation is the datasets panel)
# The same warning again within this many seconds is counted, not logged (an outage that flaps says so once).
REPEAT_WINDOW_S = 30.0


def smoke_status(config: Config) -> tuple[bool, str]:
    """(passed for this config's request shapes, why not) from smoke.json."""
    path = RunDir(config.run_dir).smoke_json
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


class Pipeline:
    """The run as the views see it: every stage (smoke, generation, tokens, merge, extract) driven from
    one place, the snapshot they read, and the control surface they call; the one-shot stages
    (smoke, merge, extract) run in core/run/stages.py."""

    read_only = False

    def __init__(self, config: Config, api_key: str, *, skip_smoke: bool = False,
                 reconstruct: bool | None = None, serve_attach: bool = True, seed: int | None = None) -> None:
        self.config = config
        self.rundir = RunDir(config.run_dir)
        self.hub = Hub()
        self._api_key = api_key
        self._redact = Redactor(api_key, config.api.management_key())
        self._skip_smoke = skip_smoke
        self._reconstruct = config.engine.reconstruct if reconstruct is None else reconstruct
        self._serve_attach = serve_attach
        self.engine = Engine(config, api_key, on_event=self.emit, on_answer=self._on_answer, seed=seed)
        self._log: EventLog | None = None
        self._attach: Any = None
        self._run_lock: RunLock | None = None
        self._reconstructor: Any = None
        self._fidelity: tuple[snap.ProviderFidelity, ...] = ()  # the last figures, kept after the workers stop
        self._ticker: asyncio.Task[None] | None = None
        self.quit_requested = asyncio.Event()
        self._exit_code = 0
        self.error: DraftgenError | None = None
        self._run_started = False   # the engine's run was started: run requests may have been sent
        self._generation = snap.StageState.IDLE
        self._startup: asyncio.Future[bool] | None = None  # the start-up smoke test (stop now cancels it)
        self._no_dialog = asyncio.Event()  # cleared while the quit dialog is open: the run does not start
        self._no_dialog.set()
        self._ledger_spent: tuple[float, float] | None = None  # (before, after) the smoke test, from spend.jsonl
        self._repeats: dict[tuple[str, str, str], list[float]] = {}  # (kind, message, dataset) -> [first seen, times]
        self.oneshot = Stages(config, api_key, self.engine, emit=self.emit)
        self.stages = self.oneshot.progress  # the stages panel's rows (one dict, shared)
        self.timeline = TimelineRecorder(self.rundir.history, on_write_error=lambda message: self.emit(
            snap.Level.WARN, snap.EventKind.HISTORY, message))

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self.rundir.root.mkdir(parents=True, exist_ok=True)
        # The run directory is live from here until close() (core/files.py `exclusive`).
        self._run_lock = exclusive(self.rundir.root, "draftgen run").acquire()
        try:
            await self._start()
        except BaseException:
            self._run_lock.release()  # not started: another run or command may use the directory
            self._run_lock = None
            raise

    async def _start(self) -> None:
        self._log = EventLog(self.rundir.events_log)
        await asyncio.to_thread(self.timeline.load)
        self.timeline.start(self._totals())
        if self._serve_attach:
            from draftgen.core.live.attach import AttachServer
            self._attach = AttachServer(self.hub, self.rundir.socket, on_warning=lambda message: self.emit(
                snap.Level.WARN, snap.EventKind.ATTACH, message))
            await self._attach.start()
        self._ticker = asyncio.create_task(self._publish_loop())
        self.publish()

    async def close(self) -> None:
        self._flush_repeats()
        self.oneshot.cancel()
        if self._reconstructor is not None:
            await self._reconstructor.close()
            self._reconstructor = None
        if self._ticker is not None:
            self._ticker.cancel()
        self.publish()
        if self._attach is not None:
            await self._attach.close()
            self._attach = None
        if self._log is not None:
            self._log.close()
        self.timeline.close()
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    @property
    def exit_code(self) -> int:
        """The run's exit code (README "exit codes"): a stage stopped before its end is incomplete (3),
        a stage that failed an error (2), never complete."""
        code = self._exit_code
        if code == EXIT_COMPLETE:
            states = {self.stages[n].state for n in self.stages if n != "smoke"}
            if snap.StageState.FAILED in states:
                return EXIT_ERROR
            if snap.StageState.STOPPED in states:
                return EXIT_INCOMPLETE
        return code

    @exit_code.setter
    def exit_code(self, code: int) -> None:
        self._exit_code = code

    async def generate(self) -> str:
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
            self._generation = snap.StageState.FAILED if self._run_started else snap.StageState.SKIPPED
            self.exit_code = getattr(e, "exit_code", 2)
            for name, stage in list(self.stages.items()):
                if stage.state == snap.StageState.RUNNING:
                    self.stages[name] = dataclasses.replace(stage, state=snap.StageState.FAILED,
                                                            message=self._redact(str(e)))
            self.engine.control.fail(self._redact(str(e)))
            self.emit(snap.Level.ERROR, snap.EventKind.RUN_FAILED, f"the run cannot go on: {e}")
            return snap.RunState.STOPPED

    async def _generate(self) -> str:
        try:
            from draftgen.core.generate.precheck import check_inputs
            from draftgen.core.generate.preflight import check_api
            # Prompt files and the tokenizer before anything is paid for (the smoke test included).
            await asyncio.to_thread(check_inputs, self.config, tokenizer=self._reconstruct)
            ok, why = (True, "") if self._skip_smoke else smoke_status(self.config)
            try:
                await check_api(self.config, self._api_key)
            except UnreachableError as e:
                # What happens next depends on the smoke gate: say that, not a wait that never comes.
                self.emit(snap.Level.WARN, snap.EventKind.UNREACHABLE,
                          f"{e}; the run waits for it (no prompt is failed meanwhile)" if ok
                          else f"{e}; the smoke test needed first retries it for up to "
                               f"{SMOKE_RETRY_S / 60:.0f} min, then the run stops")
            if warning := self.config.kind_warning():  # the server's kind is known from here
                self.emit(snap.Level.WARN, snap.EventKind.REQUEST_KEYS, warning)
            if not self._skip_smoke:
                if not ok and not self.quit_requested.is_set():
                    self.emit(snap.Level.INFO, snap.EventKind.SMOKE, f"running the smoke test first: {why}; no run request is sent "
                              "before it passes (a quit now stops it and the run does not start)")
                    before = await asyncio.to_thread(self._spent_on_disk)
                    self._startup = asyncio.ensure_future(self.oneshot.smoke())
                    await asyncio.wait({self._startup})
                    # The run's ledger is not open: the summary's spend is read from the file (the smoke request in it).
                    self._ledger_spent = (before, await asyncio.to_thread(self._spent_on_disk))
                    if self._startup.cancelled():
                        return self._not_started("the smoke test was stopped before it finished")
                    if not self._startup.result():
                        # Read in the TUI, the headless log and the shell after the TUI closes: a command, not a key.
                        self.engine.control.fail("the smoke test failed: the run will not start at full concurrency "
                                                 f"(fix what it names, then `draftgen smoke {self.config.path}`; "
                                                 "or --skip-smoke)")
                        self._generation = snap.StageState.SKIPPED
                        self.exit_code = 1
                        return snap.RunState.STOPPED
            if self.quit_requested.is_set() or not self._no_dialog.is_set():
                if not self._no_dialog.is_set():
                    self.emit(snap.Level.INFO, snap.EventKind.QUIT_DIALOG, "the run starts once the quit dialog is answered")
                    await self._no_dialog.wait()
                if self.quit_requested.is_set():
                    return self._not_started("quit before the run started")
            if self._reconstruct:
                from draftgen.core.tokens.live import LiveReconstructor
                self._reconstructor = LiveReconstructor(self.config, workers=self.config.engine.workers,
                                                        on_event=self.emit)
                await self._reconstructor.start()
                for ds in self.config.datasets:
                    await self._reconstructor.catch_up(ds.name)
            state = await self._run_engine()
            if not self._run_started:
                return self._not_started("quit before the run started")
            self._generation = (snap.StageState.DONE if state in (snap.RunState.DONE, snap.RunState.LIMITED)
                                else snap.StageState.STOPPED)
            held = self.engine.ledger.held_outcome
            if (state in INCOMPLETE or held.spooled or held.spooled_failures) and self.exit_code == EXIT_COMPLETE:
                # Prompts are left, or records wait in a spool for the next run: the shell can tell it apart.
                self.exit_code = EXIT_INCOMPLETE
            if self.engine.key_refused is not None:
                self.exit_code = EXIT_KEY_REFUSED
            if self._reconstructor is not None:
                await self._reconstructor.close()
                tokens = self.stages["tokens"] = self._reconstructor.progress()
                self._fidelity = self._reconstructor.fidelity()
                self.emit(snap.Level.INFO, snap.EventKind.TOKENS_DONE, self._reconstructor.report(None).summary_line())
                if tokens.done < tokens.total:  # the tokens stage failed: not a complete run, merge would drop them
                    self.emit(snap.Level.ERROR, snap.EventKind.TOKENS_FAILED,
                              f"tokens: {tokens.done:,} of {tokens.total:,} answers have "
                              f"token ids ({tokens.message}); finish with `draftgen tokens {self.config.path}`")
                    if self.exit_code == EXIT_COMPLETE:
                        self.exit_code = EXIT_ERROR
                for row in self._fidelity:
                    if row.flagged:
                        self.emit(snap.Level.WARN, snap.EventKind.PROVIDER_FLAGGED,
                                  f"provider {row.name}: {row.flagged} "
                                  f"(`draftgen tokens` prints what to change)")
                self._reconstructor = None
            return state
        finally:
            self.publish()

    def _not_started(self, why: str) -> str:
        """Quit before the run started: no run request was sent; exit 130 (README "exit codes")."""
        self.engine.control.end(snap.RunState.STOPPED)
        self._generation = snap.StageState.SKIPPED
        self.exit_code = EXIT_INTERRUPTED
        self.emit(snap.Level.WARN, snap.EventKind.RUN_DONE, f"{why}: no run request was sent; `draftgen run {self.config.path}` "
                  "starts it")
        return snap.RunState.STOPPED

    def _spent_on_disk(self) -> float:
        path = self.rundir.spend
        return SpendLedger.read(path).spent_usd if path.exists() else 0.0

    # -- events and snapshots -------------------------------------------------------------------

    def emit(self, level: snap.Level | str, kind: snap.EventKind | str, message: str, dataset: str = "") -> None:
        message = self._redact(message)
        if level == snap.Level.WARN:
            now = time.monotonic()
            seen = self._repeats.get((kind, message, dataset))
            if seen is not None and now - seen[0] < REPEAT_WINDOW_S:
                seen[1] += 1  # held back: counted, said when the window ends or the run closes
                return
            if len(self._repeats) > 256:
                self._flush_repeats()
            self._repeats[(kind, message, dataset)] = [now, 0]
            if seen is not None and seen[1]:
                message += f" (and {seen[1]:.0f} more like it in the {REPEAT_WINDOW_S:.0f} s before)"
        self._publish_event(level, kind, message, dataset)

    def _flush_repeats(self) -> None:
        """Say how many times each held-back warning came, and forget them."""
        held, self._repeats = self._repeats, {}
        for (kind, message, dataset), (_, times) in held.items():
            if times:
                self._publish_event(snap.Level.WARN, kind, f"{message} (and {times:.0f} more like it within "
                                    f"{REPEAT_WINDOW_S:.0f} s)", dataset)

    def _publish_event(self, level: snap.Level | str, kind: snap.EventKind | str, message: str,
                       dataset: str = "") -> None:
        event = snap.Event(time.time(), level, kind, message, dataset)  # type: ignore[arg-type]  # coerced to the enums
        if self._log is not None:
            self._log.write(level, message, event.ts)
        self.hub.publish_event(event)

    def snapshot(self) -> snap.RunSnapshot:
        s = self.engine.snapshot()
        if self._reconstructor is not None:
            self.stages["tokens"] = self._reconstructor.progress()
            self._fidelity = self._reconstructor.fidelity()
        fidelity = self._fidelity
        if self._ledger_spent is not None and not self._run_started:
            # The run never opened its ledger: what was spent (the smoke test's requests) is on spend.jsonl.
            before, after = self._ledger_spent
            s = dataclasses.replace(s, credits=dataclasses.replace(s.credits, spent_usd=max(0.0, after - before),
                                                                   spent_total_usd=after))
        return dataclasses.replace(s, generation=self._generation, stages=tuple(self.stages[n] for n in STAGES if n in self.stages),
                                   gpus=self.oneshot.gpus, fidelity=fidelity, timeline=self.timeline.timeline(), ended=self.engine.ended,
                                   recent_errors=self.engine.recent.records(),
                                   provider_stats=self.engine.provider_stats.stats(),
                                   started_at=self.timeline.started_at,
                                   first_started_at=self.timeline.first_started_at,
                                   held_answers=self.engine.ledger.held_answers, held=self.held_line())

    def held_line(self) -> str:
        """What became of the answers the disk refused this run (and those an earlier run spooled)."""
        out = self.engine.ledger.held_outcome
        parts = []
        if out.imported:
            parts.append(f"{out.imported:,} spooled answer(s) of an earlier run imported")
        if out.written:
            parts.append(f"{out.written:,} held answer(s) written once the disk took them")
        if out.spooled or out.spooled_failures:
            parts.append(f"{out.spooled:,} held answer(s) spooled to {out.spool_path} (the next `draftgen run` "
                         "imports them)")
        if out.lost:
            parts.append(f"{out.lost:,} held answer(s) LOST: neither the disk nor a spool place took them "
                         "(the next run asks them again)")
        return "; ".join(parts)

    def _totals(self) -> Totals:
        """This process's running totals for the history (core/live/timeline.py)."""
        e = self.engine
        errors = error_count(e.errors.items())
        return Totals(answers=e.ledger.rates.answers, tokens=e.ledger.rates.tokens, usd=e.money.spent_run, errors=errors,
                      in_flight=e.in_flight)

    def publish(self) -> None:
        self.hub.publish_snapshot(self.snapshot())

    async def _publish_loop(self) -> None:
        period = 1.0 / self.config.engine.snapshot_hz
        while True:
            await asyncio.sleep(period)
            self.timeline.observe(self._totals())
            self.publish()

    def _on_answer(self, dataset: str, record: dict[str, Any]) -> None:
        if self._reconstructor is not None:
            self._reconstructor.submit(dataset, record)

    async def _run_engine(self) -> str:
        """The engine's run, its spend ledger opened while no smoke test runs (one writer at a time: a
        smoke test started with s first finishes, on its own ledger; one started after books on the
        run's, core/run/stages.py)."""
        async with self.oneshot.smoke_lock:
            if self.quit_requested.is_set():  # quit while a smoke test ran: nothing is started
                return snap.RunState.STOPPED
            self._run_started = True
            self._generation = snap.StageState.RUNNING
            run = asyncio.create_task(self.engine.run())
            while not (self.engine.spend.is_open or run.done()):
                await asyncio.sleep(0.02)
        return await run

    # -- control surface (core/live/control.py) ------------------------------------------------------

    def unavailable(self, action: str) -> str | None:
        state = self.engine.state
        if action == "pause":
            return None if state == snap.RunState.RUNNING else f"nothing to pause: the run is {state.lower()}"
        if action == "resume":
            return None if state == snap.RunState.PAUSED else f"nothing to resume: the run is {state.lower()}"
        if action in ("smoke", "merge", "extract") and self.oneshot.running(action):
            return f"{action} is already running"
        if action == "merge":
            if not any(self.rundir.responses(d.name).exists() for d in self.config.datasets):
                return "nothing to merge yet: no answers on disk"
        if action == "extract":
            if not self.config.extract.model:
                return f"no model to extract with: set [extract] model in {self.config.path}"
            if not (self.rundir.merged / "tokens" / "index.jsonl").exists():
                return "no merged set yet: press m to merge first"
            if self.oneshot.running("merge"):
                return "merge is still running"
        return None

    def pause(self) -> None:
        self.engine.pause("by the user")

    def resume(self) -> None:
        self.engine.resume()

    async def smoke(self) -> bool:
        return await self.oneshot.smoke()

    async def merge(self) -> Any:
        """Merge in the foreground (stop now cancels it: None)."""
        return await self.oneshot.run("merge", self.oneshot.merge())

    async def extract(self, shard: tuple[int, int] = (0, 1)) -> Any:
        """Extract in the foreground (stop now ends it after its batch, stopped)."""
        return await self.oneshot.run("extract", self.oneshot.extract(shard))

    def run_smoke(self) -> None:
        self.oneshot.spawn("smoke", self.oneshot.smoke())

    def start_merge(self) -> None:
        self.oneshot.spawn("merge", self.oneshot.merge())

    def start_extract(self) -> None:
        self.oneshot.spawn("extract", self.oneshot.extract())

    def spool_held(self) -> None:
        """Do not wait for the disk: the answers held in memory are spooled (spool.py) as the run ends."""
        self.engine.spool_held()

    def quit_effects(self) -> QuitEffects:
        """What drain and stop now do to the stage running now (the quit dialog, headless SIGINT)."""
        return quit_effects(self.snapshot())

    def quit_asked(self, asking: bool) -> None:
        """The quit dialog is open (or closed again): a run not started yet waits for its answer."""
        if asking:
            self._no_dialog.clear()
        else:
            self._no_dialog.set()

    def quit(self, drain: bool) -> None:
        self.quit_requested.set()
        self._no_dialog.set()
        if not drain:
            if self._startup is not None:
                self._startup.cancel()  # the start-up smoke test: its request is abandoned, on the ledger
            self.oneshot.cancel()  # the extraction thread stops after its current batch
        if not self._run_started:
            return  # nothing to drain or stop yet: the run will not start (core/run/pipeline.py _generate)
        if drain:
            self.engine.drain()
        else:
            self.engine.stop()
