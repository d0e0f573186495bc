"""`draftgen run --headless`: the pipeline without the TUI, one status line every few seconds.

Made for `nohup ... &` and `tail -f`: each line stands alone and labels its averages. SIGINT drains
(a second SIGINT stops now); SIGTERM and SIGHUP (a closed tmux pane, a dropped SSH session) drain.
SIGUSR2 pauses the run (nothing is sent, retries included, until SIGUSR1); SIGUSR1 resumes it, or a run
held by the account (402, a spending limit) or a full disk; while the run waits, each status line says
WAITING and the detail lines say why. Answers the disk refused are never
dropped: a drain waits for the disk (retrying the write every few seconds) and a second SIGINT spools
them to a fallback file (core/generate/loop/spool.py) that the next run imports.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable
from typing import TextIO

from draftgen.core.config import Config
from draftgen.core.live import snapshot as snap
from draftgen.core.live.control import Action
from draftgen.core.live.events import Level, Payload
from draftgen.core.live.hub import Subscription
from draftgen.core.live.payloads import Budget, DatasetDone, DatasetStart
from draftgen.core.live.stage_payloads import Metrics, Smoke
from draftgen.core.live.summary import prompts_left, signal_line, summary_lines
from draftgen.core.quoting import sh_path
from draftgen.core.records import error_count
from draftgen.core.run import registry
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.units import clock, compact_duration, fmt_count, usd

WIDTH = 120          # every line fits a 120-column terminal
INDENT = " " * 9     # detail lines sit under the status line's state
DETAILS_EVERY = 6    # status lines between two detail blocks (and at every change)


def _fit(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def _eta(s: snap.RunSnapshot) -> str:
    """"ETA —" until the projection is stable (projection.stable_eta); never 0 while work remains."""
    eta = s.throughput.eta_s
    left = s.throughput.in_flight or prompts_left(s.datasets)
    return f"ETA {compact_duration(None if eta is not None and eta < 1 and left else eta, unknown='—')}"


def _carried(parts: list[str]) -> list[str]:
    """Detail parts joined by " | ", carried to a next line at a " | " rather than cut ("balance $64.15
    (0m4…" hid how old the balance is)."""
    lines: list[str] = []
    line = ""
    for part in parts:
        if line and len(f"{line} | {part}") > WIDTH:
            lines.append(_fit(line))
            line = ""
        line = f"{line} | {part}" if line else INDENT + part
    return lines + [_fit(line)] if line else lines


def _active(s: snap.RunSnapshot) -> list[snap.DatasetSnapshot]:
    active = [d for d in s.datasets if d.status in (snap.DatasetStatus.RUNNING, snap.DatasetStatus.PAUSED)]
    return active or [d for d in s.datasets if d.status != snap.DatasetStatus.PENDING][-1:]


def status_line(s: snap.RunSnapshot, now: float | None = None) -> str:
    """One line of at most 120 columns: wall clock, state, this run's elapsed time, progress over every
    dataset, the recent rates, in flight, errors, spend (this run and all runs against max_usd), ETA."""
    t, c = s.throughput, s.credits
    wall = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    done = sum(d.done for d in s.datasets)
    total = sum(d.total for d in s.datasets)
    pct = f" {100 * (done + sum(d.failed + d.skipped for d in s.datasets)) / total:.0f}%" if total else ""
    errors = error_count(s.errors)
    # Spend is the spend ledger over all runs, + the worst case reserved for the requests in flight, / the
    # max_usd ceiling (short: the status line holds 120 columns; the detail lines spell it out).
    ceiling = "none" if c.max_usd is None else usd(c.max_usd)
    spent = f"spent {usd(c.spent_total_usd)}+{usd(c.in_flight_usd)} rsv/{ceiling}"
    # Most important first: what does not fit in 120 columns is left to the detail lines.
    # A run that makes no progress says so on every line; the details say why (held, unreachable, backing off).
    state = f"WAITING ({s.label})" if s.waiting and s.state != snap.RunState.WAITING else s.label
    parts = [f"{wall} {state} +{clock(s.elapsed_s)}",
             f"{done:,}/{total:,}{pct}",
             spent,
             f"{t.in_flight:,} in flight",
             f"30s: {t.req_s_window:.2f} req/s {fmt_count(t.tok_s_window)} tok/s",
             f"err {errors:,}",
             _eta(s)]
    kept: list[str] = []
    for p in parts:
        if len(" | ".join(kept + [p])) <= WIDTH:
            kept.append(p)
    return _fit(" | ".join(kept))


def detail_lines(s: snap.RunSnapshot) -> list[str]:
    """What the status line leaves out, printed every few lines and whenever it changes."""
    t, c = s.throughput, s.credits
    out = []
    for d in _active(s):
        agent = (f", {d.tool_calls:,} tool calls, {d.diverged:,} diverged" + (
            f", {d.replayed:,} replayed" if d.replayed else "")) if d.tool_calls or d.diverged or d.replayed else ""
        turns = (f" turns ({d.conversations_done:,}/{d.conversations:,} conversations done, "
                 f"{d.conversations_ended:,} ended early{agent})") if d.conversations else ""
        out.append(_fit(f"{INDENT}{d.name}: {d.status} {d.done:,}/{d.total:,}{turns} answered, {d.failed:,} failed, "
                        f"{d.skipped:,} skipped, {d.in_flight:,} in flight (limit {d.effective_concurrency:,}/"
                        f"{d.concurrency:,}), {usd(d.cost_usd)}"))
    errors = error_count(s.errors)
    # The recent rates too: the status line leaves them out when the money figures are wide.
    out += _carried([
        f"limit {t.effective_concurrency:,}/{t.configured_concurrency:,}",
        f"30s: {t.req_s_window:.2f} req/s {fmt_count(t.tok_s_window)} tok/s",
        f"avg completion {t.avg_completion_tokens_window:,.0f} tok (30s) {t.avg_completion_tokens_total:,.0f} (all)",
        f"{t.req_s_total:.2f} req/s (all)", f"errors {errors:,} retries {s.retries:,}"])
    more = [f"spent {usd(c.spent_total_usd)} (all runs, {usd(c.spent_usd)} this run) / "
            f"reserved {usd(c.in_flight_usd)} / "
            f"ceiling {usd(c.max_usd) if c.max_usd is not None else 'none'}"]
    more.append(_eta(s))
    more.append(f"balance {usd(c.balance_usd)} ({compact_duration(c.balance_age_s)} old)" if c.balance_usd is not None
                else "balance unknown")
    if c.projected_total_usd is not None:
        more.append(f"projected {usd(c.projected_total_usd)} ({usd(c.projected_low_usd or 0)}-"
                    f"{usd(c.projected_high_usd or 0)})" + (", stopped by max_usd" if c.projected_capped else ""))
    if c.ceiling_limited:
        more.append("the ceiling limits concurrency")
    if c.pending_usd:
        more.append(f"{usd(c.pending_usd)} pending")
    if s.first_started_at:
        runs = len(s.timeline.runs)
        more.append(f"first started {time.strftime('%Y-%m-%d %H:%M', time.localtime(s.first_started_at))}"
                    + (f" ({runs} runs)" if runs > 1 else ""))
    out += _carried(more)
    if s.alert:
        # Wrapped, never cut: it names the path or the account condition to act on.
        out += textwrap.wrap(f"ALERT: {s.alert}", WIDTH, initial_indent=INDENT, subsequent_indent=INDENT + "  ",
                             break_long_words=False, break_on_hyphens=False)
    if s.waiting and s.waiting != s.alert:  # never wait silently: say what the run waits for
        out += textwrap.wrap(f"WAITING: {s.waiting}", WIDTH, initial_indent=INDENT,
                             subsequent_indent=INDENT + "  ", break_long_words=False, break_on_hyphens=False)
    return out


def _shape(s: snap.RunSnapshot) -> object:
    """What, when it changes, brings the details out at once."""
    return (s.state, tuple((d.name, d.status) for d in _active(s)), s.alert, bool(s.waiting))


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
                       out: TextIO = sys.stdout, reconstruct: bool | None = None,
                       then: dict[str, bool] | None = None) -> int:
    """`then`: the flags of the stages to run after generation (core/run/registry.py `chained`: `--merge`,
    `--extract`), each run in the registry's order once generation is DONE with exit code 0."""
    pipeline = Pipeline(config, api_key, skip_smoke=skip_smoke, reconstruct=reconstruct)
    await pipeline.start()
    loop = asyncio.get_running_loop()
    say = _Output(out).say
    signals = _Signals(pipeline, say)
    signals.install(loop)
    sub = pipeline.hub.subscribe(maxsize=256)
    printing = asyncio.create_task(_print_updates(sub, say, interval_s))
    try:
        state = await pipeline.generate()
        if pipeline.error is not None:
            raise pipeline.error  # printed once, at the command boundary
        for stage in registry.chained():  # the stages asked for after generation, in run order
            if pipeline.exit_code == 0 and state == snap.RunState.DONE and (then or {}).get(str(stage.flag)) \
                    and not pipeline.quit_requested.is_set():
                await pipeline.run_stage(stage.name)
        code = pipeline.exit_code  # read last: a stage stopped by a quit makes it incomplete
        await asyncio.sleep(0)  # let the printer flush the last events
        final = pipeline.snapshot()
        say(status_line(final))
        say("")
        for line in summary_lines(final, code, config_hint=sh_path(config.path)):
            say(line)
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
            signals.remove(loop)


class _Signals:
    """What a signal does to a headless run, and the line that says so: SIGINT drains (a second one
    stops now), SIGTERM and SIGHUP drain, SIGUSR2 pauses (the TUI's `p`), SIGUSR1 resumes a paused run or
    one held by the account or a full disk."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, pipeline: Pipeline, say: Callable[[str], None]) -> None:
        self._pipeline = pipeline
        self._say = say
        self._interrupts = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGTERM, self._on_term, "SIGTERM")
        loop.add_signal_handler(signal.SIGHUP, self._on_term, "SIGHUP")
        # Headless has no `r` key: SIGUSR1 resumes a run held by the account or a full disk.
        loop.add_signal_handler(signal.SIGUSR1, self._pipeline.resume)
        # Headless has no `p` key either: SIGUSR2 pauses (an operator's pause of a long run).
        loop.add_signal_handler(signal.SIGUSR2, self._on_pause)

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    def _tell(self, text: str) -> None:
        # Wrapped, not cut: a signal's line ends with what the next one does.
        for line in textwrap.wrap(text, WIDTH, subsequent_indent=INDENT, break_on_hyphens=False):
            self._say(line)

    def _held(self) -> str:
        n = self._pipeline.engine.book.held_answers
        return (f"; {n} paid answer(s) are held in memory, not on disk: the run waits for the disk (the write is "
                "retried every few seconds; SIGUSR1 retries now); a second SIGINT spools them to a fallback file"
                if n else "")

    def _on_pause(self) -> None:
        why_not = self._pipeline.unavailable(Action.PAUSE)
        if why_not is None:
            self._pipeline.pause()
        self._tell(f"SIGUSR2: {why_not}" if why_not else
                   f"SIGUSR2: paused ({self._pipeline.engine.in_flight:,} in flight finish; nothing more is sent, "
                   "retries included); SIGUSR1 resumes")

    def _on_sigint(self) -> None:
        pipeline = self._pipeline
        self._interrupts += 1
        # Act first, then say so: the saying may fail.
        effects = pipeline.quit_effects()  # what a quit does to the stage running now (smoke, merge, ...)
        if self._interrupts == 1:
            pipeline.quit(drain=True)
            self._tell(f"SIGINT: draining ({effects.running}: {effects.drain}); press Ctrl-C again to stop now "
                       f"({effects.stop})" + self._held())
        else:
            n = pipeline.engine.book.held_answers
            pipeline.quit(drain=False)  # stop now spools what is held: never dropped
            self._tell(f"SIGINT again: stopping now ({effects.running}: {effects.stop})"
                       + (f"; the {n} held answer(s) are spooled" if n else ""))

    def _on_term(self, name: str) -> None:
        line = signal_line(name, self._pipeline.snapshot(), again=self._pipeline.quit_requested.is_set())
        self._pipeline.quit(drain=True)
        self._tell(line + self._held())


# The info events the printer shows (every warning and error is shown).
# Every stage's outcome is one (core/run/registry.py `milestones`).
MILESTONES: tuple[type[Payload], ...] = (Smoke, DatasetStart, DatasetDone, Budget, Metrics, *registry.milestones())


async def _print_updates(sub: Subscription, say: Callable[[str], None], interval_s: float) -> None:
    """Events as they come (info ones only for the milestones), and a status line every `interval_s`
    with the detail lines every DETAILS_EVERY lines or when the run's shape changes."""
    loop = asyncio.get_running_loop()
    next_line = loop.time()
    lines = 0
    shape: object = None
    while True:
        item = await sub.get()
        if item[0] == "event":
            ev = item[1]
            if ev.level != Level.INFO or isinstance(ev.payload, MILESTONES):
                wall = time.strftime("%H:%M:%S", time.localtime(ev.ts))
                # Wrapped, not cut: an event's end is often what matters (a path, the figures).
                for line in textwrap.wrap(f"{wall} {ev.level:<8} {ev.message}", WIDTH,
                                          subsequent_indent=" " * 18, break_on_hyphens=False):
                    say(line)
        elif loop.time() >= next_line:
            next_line = loop.time() + interval_s
            s = item[1]
            say(status_line(s))
            if lines % DETAILS_EVERY == 0 or _shape(s) != shape:
                shape = _shape(s)
                for line in detail_lines(s):
                    say(line)
            lines += 1
