"""The few lines that say how a run ends, in the shell, the log and the quit dialog.

A run is DONE only when every usable prompt of every dataset is answered, failed for a reason of
its own, or skipped because a token budget ran out; LIMITED when `max_usd` skipped some (they stay
eligible: a higher ceiling asks them). Otherwise it ended DRAINED (a drain let the requests
in flight finish), STOPPED (stop now, or a dataset stopped by its routing) or WAITING (an account
condition held admission when it ended); the prompts not asked stay eligible and the next `run`
resumes them. The exit code tells these apart (docs/run-end.md, the exit code table).

Nothing here decides: generation's final state is RunControl.end's (core/generate/loop/run_state.py),
the label, `finished` and the exit code the run's owner's (core/run/life.py `RunLife`); these lines
read them from the snapshot and the exit code they are given.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from draftgen.core.errors import EXIT_KEY_REFUSED, ExitCode
from draftgen.core.live.snapshot import STAGE_WORDS, DatasetSnapshot, RunSnapshot, RunState, StageState
from draftgen.core.records import ErrorKind
from draftgen.core.safe_text import visible
from draftgen.core.units import clock, usd, usd_shown


class Counted(Protocol):
    """A dataset's counts: its snapshot, or the engine's live record of it."""
    @property
    def total(self) -> int: ...
    @property
    def done(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def skipped(self) -> int: ...


# Exit codes of `draftgen run` (and `demo`): docs/run-end.md, the exit code table.
EXIT_COMPLETE, EXIT_SMOKE_FAILED, EXIT_ERROR, EXIT_INCOMPLETE = (ExitCode.COMPLETE, ExitCode.SMOKE_FAILED,
                                                               ExitCode.ERROR, ExitCode.INCOMPLETE)
EXIT_INTERRUPTED = ExitCode.INTERRUPTED  # quit (or Ctrl-C) before the run started
EXIT_MEANING: dict[int, str] = {EXIT_COMPLETE: "complete", EXIT_SMOKE_FAILED: "smoke test failed", EXIT_ERROR: "error",
                EXIT_INCOMPLETE: "incomplete: run again to resume",
                EXIT_KEY_REFUSED: "the API key was refused: set a valid one, run again",
                EXIT_INTERRUPTED: "interrupted before the run started"}
WIDTH = 120


# The command that finishes a stage stopped before its end (core/live/snapshot.py STAGE_WORDS).
FINISH: dict[str, str] = {w.name: w.finish for w in STAGE_WORDS}


@dataclass(frozen=True)
class QuitEffects:
    """What a quit does now: the stage running, and what drain and stop now do to it."""
    stage: str | None
    running: str
    drain: str
    stop: str


def quit_effects(s: RunSnapshot | None) -> QuitEffects:
    """The quit dialog's and the headless SIGINT lines' words, from the stage that runs now."""
    stage = None if s is None else s.running_stage()
    n = 0 if s is None else s.throughput.in_flight
    if s is not None and s.finished:  # everything ended while the question was open: nothing to choose
        return QuitEffects(None, f"the run has ended ({s.label}) and nothing is running", "exit", "exit")
    if stage == "smoke" and s is not None and s.stage_state("generation") == StageState.IDLE:
        return QuitEffects(stage, "the start-up smoke test is running; no run request has been sent",
                           "its request finishes and is recorded, the run does not start, then exit",
                           "its request is abandoned (it stays on the spend ledger), the run does not start; exit now")
    if stage == "merge":
        return QuitEffects(stage, "merge is running", "let merge finish, then exit",
                           "merge cannot be cut midway (merged/ is replaced whole): it finishes, then exit")
    if stage == "extract":
        st = s.stage("extract") if s is not None else None
        of = f" ({st.done:,} of {st.total:,} files)" if st is not None and st.total else ""
        return QuitEffects(stage, f"extraction is running{of}", "let extraction finish every file, then exit",
                           "stop after the current batch (the files written stay valid; `draftgen extract` "
                           "finishes the rest); exit")
    if stage == "tokens" and s is not None and s.stage_state("generation") != StageState.RUNNING:
        return QuitEffects(stage, "token ids are being reconstructed", "let reconstruction finish, then exit",
                           "stop reconstruction (`draftgen tokens` finishes it); exit now")
    words = next((w for w in STAGE_WORDS if w.name == stage and w.name not in ("smoke", "generation")), None)
    if words is not None and s is not None and s.stage_state("generation") != StageState.RUNNING:
        # Any other stage of the registry (core/run/registry.py): stop now cancels it, its command finishes it.
        return QuitEffects(stage, f"{words.what} is running", f"let {words.what} finish, then exit",
                           f"stop {words.what} (`{words.finish.format(config='CONFIG')}` finishes it); exit now")
    return QuitEffects(stage, f"generation is running: {n:,} requests are in flight",
                       "stop admitting, let the requests in flight finish, then exit",
                       "exit now; the requests in flight are asked again by the next run")


def signal_line(name: str, s: RunSnapshot, *, again: bool) -> str:
    """What a drain signal (SIGTERM, SIGHUP, a first SIGINT from outside) does now, for the log and the
    shell: said before the quit acts, and never "draining" once the run has ended or already drains."""
    if s.finished:
        return f"{name}: the run has already ended ({s.label}); closing"
    if again:
        return f"{name}: already draining; the drain goes on"
    effects = quit_effects(s)
    return f"{name}: draining ({effects.running}: {effects.drain})"


def stopped_lines(s: RunSnapshot, config_hint: str) -> list[str]:
    """One line per stage stopped before its end (or never started): its counts, and what finishes it."""
    out = []
    for words in STAGE_WORDS:
        name = words.name
        state = s.stage_state(name)
        if (state not in (StageState.STOPPED, StageState.SKIPPED)
                or name == "generation" and state == StageState.STOPPED):
            continue  # a stopped generation says so in its own lines (prompts not asked yet)
        st = s.stage(name)
        counts = f" at {st.done:,} of {st.total:,}" if st is not None and st.total and not st.checks else ""
        what = words.what
        command = f"`{words.finish.format(config=config_hint)}`"
        if state == StageState.SKIPPED:
            out.append(f"{name}: skipped: {what} did not start; {command} starts it")
        else:
            out.append(f"{name}: stopped{counts}: {what} did not finish; {command} "
                       + ("runs it again" if name == "smoke" else "finishes it"))
    return out


def left(d: Counted) -> int:
    """Prompts neither answered, failed nor skipped: still to ask."""
    return max(0, d.total - d.done - d.failed - d.skipped)


def prompts_left(datasets: Iterable[Counted]) -> int:
    return sum(left(d) for d in datasets)


def ended_line(state: str, datasets: Iterable[Counted]) -> str:
    """One line for the header and the log: the end state (RunControl.end's) with its counts."""
    ds = tuple(datasets)
    total = sum(d.total for d in ds)
    head = f"{state} by max_usd" if state == RunState.LIMITED else state
    return (f"{head}: {sum(d.done for d in ds):,} of {total:,} answered, {sum(d.failed for d in ds):,} failed, "
            f"{sum(d.skipped for d in ds):,} skipped, {prompts_left(ds):,} not asked yet")


def summary_lines(s: RunSnapshot, exit_code: int, *, config_hint: str = "CONFIG") -> list[str]:
    """The block printed when the TUI closes or a headless run ends: each line fits 120 columns."""
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.first_started_at)) if s.first_started_at else "?"
    runs = len(s.timeline.runs)
    out = [f"draftgen: run {s.run_name}: {s.label} after {clock(s.elapsed_s)} this run"
           + (f" (first started {started}, {runs} runs)" if runs > 1 else "")]
    out += _dataset_rows(s)
    out += _conversation_lines(s)
    out += _spend_lines(s, runs)
    out += _tokens_lines(s, config_hint)
    out += _flagged_lines(s)
    out += _server_lines(s)
    for line in stopped_lines(s, config_hint):
        out += textwrap.wrap(line, WIDTH, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    if s.alert:
        out += textwrap.wrap(f"alert: {s.alert}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    # Answers the disk refused: written late, spooled (and where) or lost; never left unsaid.
    if s.held:
        out += textwrap.wrap(f"held answers: {s.held}", WIDTH, initial_indent="  ", subsequent_indent="    ",
                             break_long_words=False, break_on_hyphens=False)
    if s.held_answers:
        out += textwrap.wrap(f"{s.held_answers:,} paid answer(s) still held in memory, not on disk", WIDTH,
                             initial_indent="  ", subsequent_indent="    ")
    rest = prompts_left(s.datasets)
    if exit_code == EXIT_INCOMPLETE and rest:
        out += textwrap.wrap(f"{rest:,} prompts not asked yet: `draftgen run {config_hint}` again resumes them",
                             WIDTH, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    if s.state == RunState.LIMITED:
        out += textwrap.wrap(f"max_usd left prompts unasked (counted skipped, not failed): raise [budget] max_usd and "
                             f"`draftgen run {config_hint}` again asks them", WIDTH, initial_indent="  ",
                             subsequent_indent="    ", break_on_hyphens=False)
    out.append(f"  exit {exit_code} ({EXIT_MEANING.get(exit_code, 'see docs/run-end.md')})")
    return out


def _server_lines(s: RunSnapshot) -> list[str]:
    """A fleet's servers ([api] base_url a list): what each answered, its errors and time, and any out now."""
    out = []
    for p in s.provider_stats:
        if p.server:
            why = f"; out: {visible(p.out, one_line=True)}" if p.out else ""
            line = (f"server {visible(p.name, one_line=True)}: {p.answers:,} answered, {p.errors:,} errors, "
                    f"{p.completion_tokens:,} completion tokens, {p.latency_mean_s:.2f} s mean{why}")
            out += textwrap.wrap(line, WIDTH, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    return out


def agent_counts(d: DatasetSnapshot) -> str:
    """An agent dataset's tool figures after its conversation counts ("" when it has none): answers that
    called tools, conversations that diverged from the dataset (by the step they diverged at), steps sent
    with a replayed tool result."""
    if not (d.tool_calls or d.diverged or d.replayed):
        return ""
    at = ", ".join(f"t{k} {n:,}" for k, n in enumerate(d.diverged_by_number, 1) if n)
    return (f"; {d.tool_calls:,} answers called tools, {d.diverged:,} conversations diverged"
            + (f" (at {at})" if at else "") + (f", {d.replayed:,} steps sent with a replayed tool result"
                                               if d.replayed else ""))


def _conversation_lines(s: RunSnapshot) -> list[str]:
    """Under the rows: each turns = "all" dataset's counts are turns; its conversations beside them."""
    out = []
    for d in s.datasets:
        if d.conversations:
            by_turn = ", ".join(f"t{k} {done:,}/{total:,}" for k, (done, total) in enumerate(d.turns_by_number[:8], 1))
            out += textwrap.wrap(f"{d.name}: counts are turns; {d.conversations_done:,}/{d.conversations:,} "
                                 f"conversations done, {d.conversations_ended:,} ended early"
                                 + (f" (answered by turn: {by_turn})" if by_turn else "") + agent_counts(d),
                                 WIDTH, initial_indent="  ", subsequent_indent="    ")
    return out


def _dataset_rows(s: RunSnapshot) -> list[str]:
    """A row per dataset and the total row, and any dataset past its token budget."""
    out: list[str] = []
    if not sum(d.total for d in s.datasets):
        out.append("  no prompt was read: the run did not start")
    elif s.datasets:
        name_w = min(20, max(len("total"), *(len(d.name) for d in s.datasets)))
        count_w = max(len(f"{d.total:,}") for d in s.datasets)
        total_w = len(f"{sum(d.total for d in s.datasets):,}")
        w = max(count_w, total_w)

        def row(name: str, done: int, total: int, failed: int, skipped: int, rest: int, cost: str) -> str:
            return (f"  {name[:name_w]:<{name_w}} {done:>{w},}/{total:<{w},} answered {failed:>{w},} failed "
                    f"{skipped:>{w},} skipped {rest:>{w},} left  {cost}")[:WIDTH]

        for d in s.datasets:
            out.append(row(d.name, d.done, d.total, d.failed, d.skipped, left(d), usd(d.cost_usd))
                       + (f"  {d.status}" if d.status else ""))
        ds = s.datasets
        rows_usd = sum(usd_shown(d.cost_usd) for d in ds)  # the total row is the sum of the rows above it
        out.append(row("total", sum(d.done for d in ds), sum(d.total for d in ds), sum(d.failed for d in ds),
                       sum(d.skipped for d in ds), prompts_left(ds), usd(rows_usd)))
        for d in ds:  # a budget is checked at admission: answers already asked finish past it
            if d.token_budget and d.tokens_used > d.token_budget:
                over = d.tokens_used - d.token_budget
                out += textwrap.wrap(f"{d.name}: {over:,} completion tokens past its token budget of "
                                     f"{d.token_budget:,} ({100 * over / d.token_budget:.1f}%): answers already "
                                     "in flight when it was reached, kept", WIDTH, initial_indent="  ",
                                     subsequent_indent="    ")
    return out


def _spend_lines(s: RunSnapshot, runs: int) -> list[str]:
    """What was spent this run and in all, what of it was not answers, against max_usd."""
    out: list[str] = []
    c = s.credits
    # "All runs" on a first run is this run plus its smoke test: "in all" says it without a second run.
    every = "all runs of the directory" if runs > 1 else "in all"
    spend = (f"spent {usd(c.spent_usd)} this run" if usd(c.spent_usd) == usd(c.spent_total_usd) and runs <= 1
             else f"spent {usd(c.spent_usd)} this run, {usd(c.spent_total_usd)} {every}")
    rows_usd = sum(usd_shown(d.cost_usd) for d in s.datasets)
    other = usd_shown(c.spent_total_usd) - rows_usd
    if s.datasets and abs(other) >= 0.005:
        spend += f" (answers {usd(rows_usd)}, smoke tests and unanswered attempts {usd(other)})"
    if c.max_usd is not None:
        spend += f" (max_usd {usd(c.max_usd)})"
    out += textwrap.wrap(spend, WIDTH, initial_indent="  ", subsequent_indent="    ")
    return out


def _flagged_lines(s: RunSnapshot) -> list[str]:
    """Answers this run paid for and kept, flagged: cut at max_tokens, empty or from another model than the one
    asked, which the merge leaves out, a self-hosted server's answers without the ids asked for, and answers
    whose bill was not believed. A run of them is a config to fix (or a server to doubt), not luck."""
    tally = dict(s.errors)
    parts = [f"{n:,} {what}" for kind, what in (
        (ErrorKind.LENGTH, "cut at max_tokens (raise the dataset's max_tokens if they are many)"),
        (ErrorKind.EMPTY_CONTENT, "with empty content"),
        (ErrorKind.NO_IDS, "without the server's token ids"),
        (ErrorKind.OTHER_MODEL, f"from another model than {s.model} (check [api] model, [request] provider and "
                                "the server)"),
        (ErrorKind.BAD_BILL, "with a bill not believed (booked at its worst case or generation record)"))
        if (n := tally.get(kind, 0))]
    if not parts:
        return []
    left_out = (["the cut and empty ones"] if tally.get(ErrorKind.LENGTH) or tally.get(ErrorKind.EMPTY_CONTENT)
                else []) + (["those from another model"] if tally.get(ErrorKind.OTHER_MODEL) else [])
    merge = f" (merge leaves out {' and '.join(left_out)})" if left_out else ""
    return textwrap.wrap(f"answers kept but flagged this run{merge}: {'; '.join(parts)}", WIDTH, initial_indent="  ",
                         subsequent_indent="    ", break_on_hyphens=False)


def _tokens_lines(s: RunSnapshot, config_hint: str) -> list[str]:
    """How many answers have token ids, what broke, and how to finish (live reconstruction)."""
    out: list[str] = []
    tokens = next((p for p in s.stages if p.name == "tokens"), None)
    if tokens is not None:  # live reconstruction: how many answers have token ids, and how to finish
        line = f"tokens: {tokens.done:,} of {tokens.total:,} answers"
        valid, _, checked = dict(tokens.detail).get("valid", "").partition("/")  # "2/30" (during_run.py)
        if checked and valid != checked:  # answers whose ids failed a check: the merge leaves them out
            line += f", {valid} valid (each dataset's tokens/report.json says which check failed)"
        broke = tokens.state in (StageState.FAILED, StageState.STOPPED) and tokens.message
        if broke:
            line += f": {tokens.message}"  # what broke or could not be written
        if (broke or tokens.done < tokens.total) and "`draftgen tokens " not in line:
            line += f"; finish with `draftgen tokens {config_hint}`"
        out += textwrap.wrap(line, WIDTH, initial_indent="  ", subsequent_indent="    ", break_long_words=False,
                             break_on_hyphens=False)
    return out
