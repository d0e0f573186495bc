"""`draftgen run --headless`: the pipeline without the TUI, one status line every few seconds.

Made for `nohup ... &` and `tail -f`: each line stands alone and labels its averages. SIGINT drains
(a second SIGINT stops now); SIGTERM and SIGHUP (a closed tmux pane, a dropped SSH session) drain. SIGUSR1 resumes after a 402
or a full disk paused the run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import TextIO

from draftgen.core.live import snapshot as snap
from draftgen.core.config import Config
from draftgen.core.live.pipeline import Pipeline
from draftgen.core.units import compact_duration


def status_line(s: snap.RunSnapshot) -> str:
    t, c = s.throughput, s.credits
    active = [d for d in s.datasets if d.status in (snap.DatasetStatus.RUNNING, snap.DatasetStatus.PAUSED)]
    shown = active or [d for d in s.datasets if d.status != snap.DatasetStatus.PENDING][-1:]
    parts = [f"[{compact_duration(s.elapsed_s, '?')}] {s.state}"]
    for ds in shown:
        parts.append(f"{ds.name} {ds.done + ds.failed}/{ds.total} ({ds.failed} failed, {ds.skipped} skipped)")
    parts.append(f"req/s {t.req_s_window:.1f} (30s) {t.req_s_total:.1f} (all)")
    parts.append(f"tok/s {t.tok_s_window:,.0f} (30s)")
    parts.append(f"in flight {t.in_flight} (limit {t.effective_concurrency}/{t.configured_concurrency})")
    parts.append(f"avg completion tok {t.avg_completion_tokens_window:,.0f} (30s) "
                 f"{t.avg_completion_tokens_total:,.0f} (all)")
    errors = sum(n for k, n in s.errors if k not in ("length", "empty_content"))
    parts.append(f"errors {errors} retries {s.retries}")
    spent = f"spent ${c.spent_usd:.2f}"
    if c.max_usd is not None:
        spent += f"/{c.max_usd:.2f}"
    parts.append(spent)
    if c.balance_usd is not None:
        parts.append(f"balance ${c.balance_usd:.2f} ({compact_duration(c.balance_age_s, '?')} old)")
    parts.append(f"ETA {compact_duration(t.eta_s, '?')}")
    line = " | ".join(parts)
    if s.alert:
        line += f"\n  ALERT: {s.alert}"
    return line


class _Output:
    """Where the status lines go. The terminal can vanish under a long run (a closed tmux pane, a
    dropped SSH session): a write that fails must neither stop the run nor keep it from hearing the
    SIGHUP that follows, so after the first failure the output is silenced, not raised."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def say(self, text: str) -> None:
        if self.gone:
            return
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # EPIPE, EIO from a hung-up terminal; a closed file
            self.gone = True
            try:
                # What is still buffered would fail again at exit (and turn exit status 0 into 120).
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):
                pass  # not a real file (a test's StringIO)


async def run_headless(config: Config, api_key: str, *, skip_smoke: bool = False, interval_s: float = 5.0,
                       out: TextIO = sys.stdout, merge: bool = False, extract: bool = False,
                       reconstruct: bool | None = None) -> int:
    pipeline = Pipeline(config, api_key, skip_smoke=skip_smoke, reconstruct=reconstruct)
    await pipeline.start()
    loop = asyncio.get_running_loop()
    interrupts = 0
    say = _Output(out).say

    def on_sigint() -> None:
        nonlocal interrupts
        interrupts += 1
        # Act first, then say so: the saying may fail.
        if interrupts == 1:
            pipeline.quit(drain=True)
            say("SIGINT: draining (requests in flight finish); press Ctrl-C again to stop now")
        else:
            pipeline.quit(drain=False)
            say("SIGINT again: stopping now")

    def on_term(name: str) -> None:
        pipeline.quit(drain=True)
        say(f"{name}: draining")

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, on_term, "SIGTERM")
    loop.add_signal_handler(signal.SIGHUP, on_term, "SIGHUP")
    # Headless has no `r` key: SIGUSR1 resumes a run paused by a 402 or a full disk.
    loop.add_signal_handler(signal.SIGUSR1, pipeline.resume)
    sub = pipeline.hub.subscribe(maxsize=256)

    async def printer() -> None:
        next_line = loop.time()
        while True:
            item = await sub.get()
            if item[0] == "event":
                ev = item[1]
                if ev.level != "info" or ev.kind in ("dataset_start", "dataset_done", "run_done", "smoke_done",
                                                      "merge_done", "extract_done", "budget", "tokens_done"):
                    say(f"  {ev.level}: {ev.message}")
            elif loop.time() >= next_line:
                next_line = loop.time() + interval_s
                say(status_line(item[1]))

    printing = asyncio.create_task(printer())
    try:
        state = await pipeline.generate()
        if pipeline.error is not None:
            raise pipeline.error  # printed once, at the command boundary
        code = pipeline.exit_code
        if code == 0 and state == snap.RunState.DONE and merge:
            await pipeline.merge()
        if code == 0 and state == snap.RunState.DONE and extract:
            await pipeline.extract()
        say(status_line(pipeline.snapshot()))
        await asyncio.sleep(0)  # let the printer flush the last events
        return code
    finally:
        printing.cancel()
        sub.close()
        try:
            # The handlers stay until the pipeline is closed: a second Ctrl-C that lands after the drain
            # ended, while token files and reports are still being finished, is answered like any other,
            # not with Python's KeyboardInterrupt in the middle of writing them (and a traceback, exit 1).
            await pipeline.close()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)
