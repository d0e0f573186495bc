"""The payload classes (core/live/events.py) of the run's stages and its frame: the smoke test, the
run's end, token reconstruction, the merge and the extraction, a signal, the attach server and
history.jsonl. Each carries its figures and renders its message; `PAYLOADS` (core/live/payloads.py)
holds them beside the generation's."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from draftgen.core.live.events import EventKind, Level, Payload
from draftgen.core.units import usd


@dataclass(frozen=True, kw_only=True)
class Attach(Payload):
    """ATTACH: the attach server or viewer (connected, lost, refused); `detail`: what it says."""
    kind = EventKind.ATTACH
    usual = Level.WARN
    detail: str

    def text(self) -> str:
        return self.detail


@dataclass(frozen=True, kw_only=True)
class History(Payload):
    """HISTORY: history.jsonl (`path`) could not be written; `cause`: the error."""
    kind = EventKind.HISTORY
    usual = Level.WARN
    path: str
    cause: str

    def text(self) -> str:
        return f"{self.path}: history no longer written: {self.cause}"


@dataclass(frozen=True, kw_only=True)
class StageDone(Payload):
    """A stage's outcome (SMOKE_DONE, RUN_DONE, TOKENS_DONE, MERGE_DONE, EXTRACT_DONE); `crashed`: the
    error of a stage that crashed (core/run/stages.py), said as `<stage> crashed: ...` instead."""
    stage: typing.ClassVar[str]
    crashed: str = ""

    def text(self) -> str:
        return f"{self.stage} crashed: {self.crashed}" if self.crashed else self.said()

    def said(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class SmokeDone(StageDone):
    """SMOKE_DONE: the smoke test's outcome: `outcome` "passed", "failed", "stopped" (its request
    abandoned) or "error" (it could not run); `detail`: its summary, or the error."""
    kind = EventKind.SMOKE_DONE
    stage = "smoke"
    outcome: str = ""
    detail: str = ""

    def said(self) -> str:
        if self.outcome == "error":
            return f"smoke test could not run: {self.detail}"
        if self.outcome == "stopped":
            return "smoke test stopped before it finished: its request was abandoned (it stays on the spend ledger)"
        return f"smoke test {'passed' if self.outcome == 'passed' else 'FAILED'}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class RunDone(StageDone):
    """RUN_DONE: the run ended in `state` (`ended`: the line that says how, with its datasets' counts)
    and what it spent, this run and all runs (`pending_usd` of it at worst case); or it never started
    (`not_started`: why, `config` the path to run again)."""
    kind = EventKind.RUN_DONE
    stage = "run"
    state: str = ""
    ended: str = ""
    spent_run_usd: float = 0.0
    spent_usd: float = 0.0
    pending_usd: float | None = None
    not_started: str = ""
    config: str = ""

    def said(self) -> str:
        if self.not_started:
            return f"{self.not_started}: no run request was sent; `draftgen run {self.config}` starts it"
        return (f"run {self.ended}; {usd(self.spent_run_usd)} spent this run, {usd(self.spent_usd)} all runs"
                + (f" ({usd(self.pending_usd)} of it pending, at worst case)" if self.pending_usd is not None else ""))


@dataclass(frozen=True, kw_only=True)
class TokensDone(StageDone):
    """TOKENS_DONE: token reconstruction's summary (`summary`: the report's line)."""
    kind = EventKind.TOKENS_DONE
    stage = "tokens"
    summary: str = ""

    def said(self) -> str:
        return self.summary


@dataclass(frozen=True, kw_only=True)
class TokensFailed(Payload):
    """TOKENS_FAILED: token reconstruction stopped (`stopped`: the disk refused) or failed at `done` of
    `total` answers (`cause`: why; `config`: the path `draftgen tokens` finishes); or, with no total,
    its workers gave up (`cause`: what the pool says)."""
    kind = EventKind.TOKENS_FAILED
    usual = Level.ERROR
    cause: str
    done: int = 0
    total: int = 0
    stopped: bool = False
    config: str = ""

    def text(self) -> str:
        if self.stopped:
            return f"tokens: stopped at {self.done:,} of {self.total:,} answers: {self.cause}"
        if self.config:
            return (f"tokens: {self.done:,} of {self.total:,} answers have token ids ({self.cause}); finish with "
                    f"`draftgen tokens {self.config}`")
        return self.cause


@dataclass(frozen=True, kw_only=True)
class MergeDone(StageDone):
    """MERGE_DONE: the merge's outcome: `outcome` "done" (`kept` of `read` answers, `tokens`, `dropped`
    by why, the `train` file), "failed" (`detail`: the error), "abandoned" (not waited for; `config`
    the path to merge again), or "note" (`detail`: the contamination or hidden_states line)."""
    kind = EventKind.MERGE_DONE
    stage = "merge"
    outcome: str = ""
    kept: int = 0
    read: int = 0
    tokens: int = 0
    dropped: str = "none"
    train: str = ""
    config: str = ""
    detail: str = ""

    def said(self) -> str:
        if self.outcome == "done":
            return (f"merge done: {self.kept} of {self.read} answers kept ({self.tokens:,} tokens), dropped: "
                    f"{self.dropped}; {self.train}")
        if self.outcome == "failed":
            return f"merge failed: {self.detail}"
        if self.outcome == "abandoned":
            return (f"merge was not waited for: merged/ is replaced whole or not at all (`draftgen merge "
                    f"{self.config}` redoes it)")
        return self.detail


@dataclass(frozen=True, kw_only=True)
class ExtractDone(StageDone):
    """EXTRACT_DONE: the extraction's outcome: `outcome` "done", "stopped" or "failed" (`cause`);
    `written` files this time, `existing` already there, `nan` and `too_long` skipped, `tokens` written
    at `tok_s`, in `hidden_states`; stopped at `done` of `samples` files (`config`: the path that
    finishes it). `short`: said the way `draftgen extract` says it (counts only)."""
    kind = EventKind.EXTRACT_DONE
    stage = "extract"
    outcome: str = ""
    cause: str = ""
    written: int = 0
    existing: int = 0
    nan: int = 0
    too_long: int = 0
    tokens: int = 0
    tok_s: float = 0.0
    done: int = 0
    samples: int = 0
    hidden_states: str = ""
    config: str = ""
    short: bool = False

    def said(self) -> str:
        if self.outcome == "failed":
            return f"extraction failed: {self.cause}"
        if self.short:
            return (f"extraction {self.outcome}: {self.written:,} files written ({self.existing:,} already there, "
                    f"{self.nan:,} NaN)")
        if self.outcome == "stopped":
            return (f"extraction STOPPED at {self.done:,} of {self.samples:,} files ({self.written} written this "
                    f"time) in {self.hidden_states}; `draftgen extract {self.config}` finishes the rest")
        return (f"extraction done: {self.written} files written ({self.existing} already there, {self.nan} NaN"
                + (f", {self.too_long} longer than the context: skipped" if self.too_long else "")
                + f"), {self.tokens:,} tokens at {self.tok_s:,.0f} tok/s in {self.hidden_states}")


@dataclass(frozen=True, kw_only=True)
class Signal(Payload):
    """SIGNAL: a signal came (`signal`): `detail` what the run does about it (tui/signals.py), `held`
    paid answers in memory waiting for the disk; `again`: a second SIGINT, stop now."""
    kind = EventKind.SIGNAL
    usual = Level.WARN
    signal: str
    detail: str = ""
    held: int = 0
    again: bool = False

    def text(self) -> str:
        if self.again:
            return f"{self.signal} again: stopping now (held answers are spooled)"
        return self.detail + (f"; {self.held} paid answer(s) held in memory wait for the disk (SIGINT spools them)"
                              if self.held else "")


@dataclass(frozen=True, kw_only=True)
class Metrics(Payload):
    """METRICS: the /metrics server ([monitor] metrics) and its address."""
    kind = EventKind.METRICS
    url: str

    def text(self) -> str:
        return f"metrics: serving {self.url}"


@dataclass(frozen=True, kw_only=True)
class Paused(Payload):
    """PAUSED: the user paused the run (`by`: how)."""
    kind = EventKind.PAUSED
    by: str

    def text(self) -> str:
        return f"paused {self.by} (requests in flight finish and are recorded; none is retried while paused)"


@dataclass(frozen=True, kw_only=True)
class Resumed(Payload):
    """RESUMED: the run admits again."""
    kind = EventKind.RESUMED

    def text(self) -> str:
        return "resumed"


@dataclass(frozen=True, kw_only=True)
class Draining(Payload):
    """DRAINING: nothing more is admitted; the requests in flight finish."""
    kind = EventKind.DRAINING
    in_flight: int

    def text(self) -> str:
        return f"draining: waiting for {self.in_flight} requests in flight"


@dataclass(frozen=True, kw_only=True)
class Stopping(Payload):
    """STOPPING: stop now: the requests in flight abandoned."""
    kind = EventKind.STOPPING
    usual = Level.WARN
    abandoned: int

    def text(self) -> str:
        return f"stopping now: {self.abandoned} requests in flight abandoned (they stay eligible for the next run)"


@dataclass(frozen=True, kw_only=True)
class QuitDialog(Payload):
    """QUIT_DIALOG: the run waits for the quit dialog's answer before it starts."""
    kind = EventKind.QUIT_DIALOG

    def text(self) -> str:
        return "the run starts once the quit dialog is answered"


@dataclass(frozen=True, kw_only=True)
class Smoke(Payload):
    """SMOKE: the smoke test runs first; `why`: what asks for it."""
    kind = EventKind.SMOKE
    why: str

    def text(self) -> str:
        return (f"running the smoke test first: {self.why}; no run request is sent before it passes (a quit now "
                "stops it and the run does not start)")


@dataclass(frozen=True, kw_only=True)
class RunFailed(Payload):
    """RUN_FAILED: the run cannot go on; `cause`: the error that stopped it."""
    kind = EventKind.RUN_FAILED
    usual = Level.ERROR
    cause: str

    def text(self) -> str:
        return f"the run cannot go on: {self.cause}"


@dataclass(frozen=True, kw_only=True)
class HeldWait(Payload):
    """HELD_WAIT: paid answers held in memory, waiting for the disk."""
    kind = EventKind.HELD_WAIT
    usual = Level.WARN
    answers: int
    retry_s: float

    def text(self) -> str:
        return (f"{self.answers} paid answer(s) are held in memory, not on disk: the run waits for the disk, "
                f"retrying every {self.retry_s:g} s (free space; r or SIGUSR1 retries now); quit again (a second "
                "SIGINT) to spool them to a fallback file")


@dataclass(frozen=True, kw_only=True)
class HeldWritten(Payload):
    """HELD_WRITTEN: the disk took the records held in memory."""
    kind = EventKind.HELD_WRITTEN

    def text(self) -> str:
        return "the disk took the held records: every answer is on disk"


@dataclass(frozen=True, kw_only=True)
class Spooled(Payload):
    """SPOOLED: answers held in memory (the disk refused them: `cause`) spooled to `path`."""
    kind = EventKind.SPOOLED
    usual = Level.WARN
    answers: int
    cause: str
    path: str
    run_dir: str

    def text(self) -> str:
        return (f"{self.answers} answer(s) held in memory (the disk refused them: {self.cause}) are spooled to "
                f"{self.path}; the next `draftgen run` of {self.run_dir} imports them before it sends anything")


@dataclass(frozen=True, kw_only=True)
class SpoolImported(Payload):
    """SPOOL: a spool file (`path`) imported (`records`, `answers` of them, into `run_dir`), or not:
    `outcome` "imported", "refused" or "kept" (nothing imported, `cause`: why), "not_removed" (imported,
    `cause`: why it stays)."""
    kind = EventKind.SPOOL
    path: str
    outcome: str
    cause: str = ""
    records: int = 0
    answers: int = 0
    run_dir: str = ""

    @property
    def level(self) -> Level:
        return self.at or {"refused": Level.ERROR, "kept": Level.ERROR, "not_removed": Level.WARN}.get(
            self.outcome, Level.INFO)

    def text(self) -> str:
        if self.outcome == "refused":
            return (f"{self.path} was refused, nothing in it imported: {self.cause}; a spool is read only from a "
                    "folder of yours that no other user can write, and only from a file of yours (remove it if you "
                    "did not write it)")
        if self.outcome == "kept":
            return (f"{self.path} was not imported: {self.cause}; it stays (run again with those datasets, or move "
                    "its records by hand)")
        if self.outcome == "not_removed":
            return (f"{self.path}: imported, but cannot remove it ({self.cause}); a later run skips what is already "
                    "on disk")
        return (f"imported {self.records} spooled record(s) ({self.answers} answers) from {self.path} into "
                f"{self.run_dir}; the spool file is removed")


@dataclass(frozen=True, kw_only=True)
class Unsaved(Payload):
    """UNSAVED: `records` the disk never took (`where`: how many for which file; `cause`: the disk's
    error), and no spool place took them either (`refused`: why each did not)."""
    kind = EventKind.UNSAVED
    usual = Level.ERROR
    records: int
    where: str
    cause: str
    refused: str

    def text(self) -> str:
        return (f"{self.records} record(s) could not be written and are not saved ({self.where}): {self.cause}; no "
                f"spool place took them either ({self.refused}); the next run asks those prompts again")


@dataclass(frozen=True, kw_only=True)
class Repaired(Payload):
    """REPAIRED: a half-written last line (`cut_bytes`) cut from `path`; `by_crash`: said as a crash's."""
    kind = EventKind.REPAIRED
    usual = Level.WARN
    path: str
    cut_bytes: int
    by_crash: bool = False

    def text(self) -> str:
        return (f"{self.path}: cut a half-written last line ({self.cut_bytes} bytes)"
                + (" left by a crash" if self.by_crash else ""))


@dataclass(frozen=True, kw_only=True)
class TokensWorkerDied(Payload):
    """TOKENS_WORKER_DIED: a reconstruction worker died; new ones start (`restarts` of at most `limit`)."""
    kind = EventKind.TOKENS_WORKER_DIED
    usual = Level.WARN
    restarts: int
    limit: int
    in_flight: int

    def text(self) -> str:
        return (f"a token reconstruction worker process died (killed, or out of memory): starting new workers "
                f"({self.restarts} of at most {self.limit}); {self.in_flight:,} answers in flight are sent again")
