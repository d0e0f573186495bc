"""Start the TUI: with the pipeline embedded on the app's own event loop, or attached read-only."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

from draftgen.core.config import Config
from draftgen.core.live import stage_payloads as ev
from draftgen.core.live.control import Action
from draftgen.core.live.summary import signal_line, summary_lines
from draftgen.core.quoting import sh_path
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.safe_text import visible
from draftgen.tui.app import DraftgenApp


async def run_tui(config: Config, api_key: str, *, skip_smoke: bool = False, after_run: list[str] | None = None,
                  out: TextIO = sys.stdout, run_app: Callable[[DraftgenApp], Awaitable[object]] | None = None) -> int:
    """The app and the engine share one event loop; every panel reads the pipeline's snapshots.
    `run_app` runs the app (default: on this terminal; a test passes Textual's headless pilot)."""
    pipeline = Pipeline(config, api_key, skip_smoke=skip_smoke)
    await pipeline.start()
    app = DraftgenApp(pipeline, title=f"draftgen · {visible(config.run_dir.name)}", run_dir=config.run_dir)

    async def generate_then() -> None:
        state = await pipeline.generate()
        # The demo chains merge and extraction after generation, as a user would press m then x.
        for stage in after_run or ():
            if pipeline.quit_requested.is_set() or state != "DONE":
                return
            await pipeline.run_stage(stage)

    work = asyncio.create_task(generate_then())
    loop = asyncio.get_running_loop()
    signalled: list[str] = []
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, pipeline, app, signalled, sig.name)
    loop.add_signal_handler(signal.SIGUSR1, pipeline.resume)  # as in headless: also after the pane closed
    loop.add_signal_handler(signal.SIGUSR2, _pause, pipeline)  # as in headless: `p` from another shell
    try:
        await (app.run_async() if run_app is None else run_app(app))
    finally:
        await _end_work(pipeline, work, signalled=bool(signalled))
        await pipeline.close()
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        # The screen is gone: say in the shell how the run ended (also after a failed smoke or an error), with
        # the exit code the shell gets (the run's owner's: an error's own, 4 for a key refused at the start).
        print("\n".join(summary_lines(pipeline.snapshot(), pipeline.exit_code, config_hint=sh_path(config.path))),
              file=out, flush=True)
    if pipeline.error is not None:
        raise pipeline.error  # shown in the UI's alert bar; printed again once the screen is gone
    return pipeline.exit_code


def _pause(pipeline: Pipeline) -> None:
    """SIGUSR2: pause as `p` does, where a pause can be (the header says PAUSED; SIGUSR1 or `r` resumes)."""
    if pipeline.unavailable(Action.PAUSE) is None:
        pipeline.pause()


def _on_signal(pipeline: Pipeline, app: DraftgenApp, signalled: list[str], name: str) -> None:
    """SIGHUP (the pane closed), SIGTERM, SIGINT from outside: drain like the headless run; a later
    SIGINT stops now. The held answers are waited for or spooled, never dropped (engine.py). The line
    is logged before the quit acts, and says what this signal does now (a run already ended or already
    draining is not said to start draining again)."""
    again = bool(signalled)
    signalled.append(name)
    if again and name == "SIGINT":
        pipeline.emit(ev.Signal(signal=name, again=True))
        pipeline.quit(drain=False)
    else:
        n = pipeline.engine.book.held_answers
        pipeline.emit(ev.Signal(signal=name, detail=signal_line(name, pipeline.snapshot(), again=again), held=n))
        pipeline.quit(drain=True)
    if name == "SIGHUP":
        _silence_terminal()  # nothing to draw on any more: every later write goes to /dev/null
        if app.is_running:
            app.exit()
    else:
        app.quit_requested = True  # the screen stays until the run has ended, as after d in the dialog
        if pipeline.snapshot().finished and app.is_running:
            app.exit()


async def _end_work(pipeline: Pipeline, work: asyncio.Task[None], *, signalled: bool) -> None:
    """The app has closed: after a signal the drain goes on without a screen (a second SIGINT stops
    it); otherwise, or if it is still going, the run stops now (given 30 s, then cancelled)."""
    if not work.done() and signalled:
        try:
            await work
        except Exception:  # noqa: BLE001 - the pipeline keeps its own error; the summary says it
            pass
    if not work.done():
        pipeline.quit(drain=False)
        try:
            await asyncio.wait_for(work, 30)
        except (TimeoutError, asyncio.CancelledError, Exception):
            work.cancel()


def _silence_terminal() -> None:
    """The terminal hung up: point stdin, stdout and stderr at /dev/null so that Textual's last writes
    and the summary neither fail (EIO) nor turn the exit status into 120."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in (0, 1, 2):
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


async def attach_tui(run_dir: Path) -> int:
    """The read-only viewer; AttachError (exit 2, said by the command) when this user may not attach."""
    from draftgen.core.live.attach import check_access
    from draftgen.core.live.attach_viewer import AttachControls
    await asyncio.to_thread(check_access, run_dir)  # "permission denied" now, not a viewer that waits for ever
    controls = AttachControls(run_dir)
    await controls.start()
    try:
        await DraftgenApp(controls, title=f"draftgen · {visible(run_dir.resolve().name)} (attached)",
                          run_dir=run_dir).run_async()
    finally:
        await controls.close()
    if controls.error is not None:
        raise controls.error
    return 0
