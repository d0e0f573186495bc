"""The one-shot stages beside generation: the smoke test, merge and extraction, each run on demand
(a key, a command) with its progress told to the stages panel's rows (stage_rows.py), and
extraction's GPU samples for the GPU panel. The Pipeline (core/run/pipeline.py) owns one and calls
it from its control surface.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from draftgen.core.config import Config
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.run_state import PausedBy
from draftgen.core.live import snapshot as snap
from draftgen.core.live import stage_payloads as ev
from draftgen.core.live.events import EventKind, EventSink, Level
from draftgen.core.live.payloads import PAYLOADS
from draftgen.core.quoting import sh_path
from draftgen.core.run.stage_rows import StageRows
from draftgen.core.rundir import RunDir
from draftgen.core.secrets import Redactor


class Stages:
    def __init__(self, config: Config, api_key: str, engine: Engine, rows: StageRows, *, rundir: RunDir,
                 redact: Redactor, emit: EventSink) -> None:
        self._config = config
        self._api_key = api_key
        self._rundir = rundir
        self._redact = redact
        self._emit = emit
        self.engine = engine
        self._rows = rows  # the stages panel's rows: this class only tells them
        self.gpus: tuple[snap.GpuStat, ...] | None = None
        self.extract_stop = threading.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.smoke_lock = asyncio.Lock()

    def running(self, name: str) -> bool:
        task = self._tasks.get(name)
        return task is not None and not task.done()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a stage in the background: its errors become an event and a failed row, never a crash."""
        async def guarded() -> None:
            try:
                await coro
            except DraftgenError:
                pass  # already reported as an event and in the stage panel
            except Exception as e:  # a stage crash must not take the run down
                self._rows.fail(name, f"{type(e).__name__}: {e}")
                done = PAYLOADS[EventKind(f"{name}_done")]  # SmokeDone, MergeDone, ExtractDone, ...
                assert issubclass(done, ev.StageDone)
                self._emit(done(crashed=f"{type(e).__name__}: {e}", at=Level.ERROR))
        self._tasks[name] = asyncio.create_task(guarded())

    async def run(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a stage in the foreground, cancellable like a spawned one (stop now): None when stopped."""
        task = self._tasks[name] = asyncio.ensure_future(coro)
        await asyncio.wait({task})
        return None if task.cancelled() else task.result()

    def task(self, name: str) -> asyncio.Task[Any] | None:
        return self._tasks.get(name)

    def cancel(self) -> None:
        self.extract_stop.set()  # the extraction thread stops after its current batch, and says so
        for name, task in self._tasks.items():
            # Merge's thread cannot be cut midway (merged/ is replaced whole): it is let finish.
            if not task.done() and name not in ("extract", "merge"):
                task.cancel()

    async def smoke(self) -> bool:
        """The smoke test, one at a time (`smoke_lock`, which the run also holds while it opens its spend
        ledger): on the run's ledger when it is open, else on its own."""
        async with self.smoke_lock:
            return await self._smoke()

    async def _smoke(self) -> bool:
        from draftgen.core.generate.commands.smoke import run_smoke
        self._rows.start("smoke")
        was_running = self.engine.state == snap.RunState.RUNNING
        if was_running:
            self.engine.pause(PausedBy.SMOKE)
        try:
            # A run open in this process: the smoke requests go on its ledger, under its reservations.
            spend = self.engine.spend if self.engine.spend.is_open else None
            result = await run_smoke(self._config, self._api_key, progress=self._rows.reporter("smoke"), spend=spend,
                                     settler=self.engine.settler if spend is not None else None,
                                     rundir=self._rundir, redact=self._redact)
        except DraftgenError as e:
            self._rows.fail("smoke", self._redact(str(e)))
            self._emit(ev.SmokeDone(outcome="error", detail=str(e), at=Level.ERROR))
            return False
        except asyncio.CancelledError:
            self._rows.stop("smoke", "stopped before it finished (its requests stay on the spend ledger)")
            self._emit(ev.SmokeDone(outcome="stopped", at=Level.WARN))
            raise
        finally:
            if was_running:
                self.engine.resume()
        passed = bool(result.passed)
        self._emit(ev.SmokeDone(outcome="passed" if passed else "failed", detail=result.summary(),
        at=Level.INFO if passed else Level.ERROR))
        return passed

    async def merge(self, replace_hidden_states: bool = False) -> Any:
        from draftgen.core.merge.merge import merge
        self._rows.start("merge")
        try:
            stats = await asyncio.to_thread(merge, self._config, self._rows.reporter("merge"),
                                            replace_hidden_states=replace_hidden_states)
        except asyncio.CancelledError:
            self._rows.stop("merge", f"not waited for: merged/ is replaced whole or not at all; "
                          f"`draftgen merge {sh_path(self._config.path)}` redoes it")
            self._emit(ev.MergeDone(outcome="abandoned", config=sh_path(self._config.path), at=Level.WARN))
            raise
        except DraftgenError as e:
            self._rows.fail("merge", str(e))
            self._emit(ev.MergeDone(outcome="failed", detail=str(e), at=Level.ERROR))
            raise
        dropped = ", ".join(f"{n} {why}" for why, n in stats.dropped.items() if n) or "none"
        self._emit(ev.MergeDone(outcome="done", kept=stats.samples, read=stats.read, tokens=stats.tokens,
                                dropped=dropped, train=f"{self._rundir.merged}/train.jsonl"))
        if stats.contamination:
            from draftgen.core.merge.command import contamination_line
            self._emit(ev.MergeDone(outcome="note", detail=contamination_line(stats)))
        if stats.hidden_states:
            self._emit(ev.MergeDone(outcome="note", detail=stats.hidden_states,
            at=Level.WARN if "set aside" in stats.hidden_states else Level.INFO))
        return stats

    async def extract(self, shard: tuple[int, int] = (0, 1), on_other_merge: str = "refuse") -> Any:
        from draftgen.core.extract import extract
        from draftgen.core.extract.gpu import GpuMonitor
        monitor = GpuMonitor()
        sampler = asyncio.create_task(monitor.run(self._set_gpus, interval_s=1.0))
        self._rows.start("extract")
        try:
            self.extract_stop.clear()
            stats = await asyncio.to_thread(extract, self._config, shard=shard, progress=self._rows.reporter("extract"),
                                            stop=self.extract_stop, on_other_merge=on_other_merge)
        except asyncio.CancelledError:
            self._rows.stop("extract", f"stopped: `draftgen extract {sh_path(self._config.path)}` finishes the rest")
            raise
        except DraftgenError as e:
            self._rows.fail("extract", str(e))
            self._emit(ev.ExtractDone(outcome="failed", cause=str(e), at=Level.ERROR))
            raise
        finally:
            sampler.cancel()
        if stats.stopped:  # stopped after a batch (stop now, a full disk): said as stopped, with what finishes it
            done = stats.skipped_existing + stats.written + stats.nan_samples
            self._rows.stop("extract", f"stopped at {done:,} of {stats.samples:,} files: "
                          f"`draftgen extract {sh_path(self._config.path)}` finishes the rest")
            self._emit(ev.ExtractDone(outcome="stopped", done=done, samples=stats.samples, written=stats.written,
                                      hidden_states=str(self._rundir.hidden_states),
                                      config=sh_path(self._config.path), at=Level.WARN))
            return stats
        self._emit(ev.ExtractDone(outcome="done", written=stats.written, existing=stats.skipped_existing,
                                  nan=stats.nan_samples, too_long=stats.too_long_samples,
                                  tokens=stats.tokens_written, tok_s=stats.tokens_per_s,
                                  hidden_states=str(self._rundir.hidden_states)))
        return stats

    def _set_gpus(self, gpus: tuple[snap.GpuStat, ...] | None) -> None:
        self.gpus = gpus

