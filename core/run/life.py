"""The run's life and its one owner: `RunLife`, built once per run by the pipeline.

The parts report facts; this module decides from them, once each:

    generation (the engine's RunControl, core/generate/loop/run_state.py): its state, alert, how it
        ended (the final state RunControl.end decides from what the run left, and its ended line), a
        refused key, what became of the records the disk refused
    every other stage (StageRows, stage_rows.py): its progress, written by the stage itself
    the pipeline (generation.py): the run launched, the smoke test failed, quit before the start, the
        error that stopped it, the tokens stage's report at the end

    RunLife.generation()  the generation stage's state (the stages panel's generation row)
    standing()            the label every view shows and whether the run is finished (nothing left to
                          wait for), carried in the snapshot as data (RunLife.now): the TUI header,
                          the headless lines, the summary block and an attached viewer read it as is
    RunLife.exit_code     the exit code (docs/run-end.md), weighing the other stages as the label does
                          (weighed), so the word a view shows and the code the shell gets never disagree

The error that stopped the run is kept here for the command boundary to print.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from draftgen.core.errors import DraftgenError, ExitCode
from draftgen.core.generate.loop.run_state import LIVE, RunControl
from draftgen.core.live.snapshot import STAGE_NAMES, STAGE_RUNNING_LABEL, RunState, StageProgress, StageState
from draftgen.core.run.stage_rows import StageRows
from draftgen.core.secrets import Redactor

# The final states with prompts left (or skipped by max_usd): the run is incomplete, exit 3.
INCOMPLETE = (RunState.DRAINED, RunState.STOPPED, RunState.WAITING, RunState.LIMITED)


def weighed(rows: Iterable[StageProgress]) -> StageState | None:
    """How the other stages weigh on a run whose generation ended complete: FAILED when one failed (exit 2),
    else STOPPED when one stopped before its end (exit 3), else None. The smoke test is left out: it gates
    the run and is not its work (one started by hand and stopped leaves the run DONE, exit 0)."""
    seen = {row.state for row in rows if row.name != "smoke"}
    return next((st for st in (StageState.FAILED, StageState.STOPPED) if st in seen), None)


@dataclass(frozen=True)
class RunStanding:
    """How the run stands as a whole: the word every view shows, and whether nothing is left to wait for."""
    label: str
    finished: bool


def standing(state: RunState, generation: StageState, rows: Iterable[StageProgress]) -> RunStanding:
    """The one rule for the label and `finished`, from generation's state (RunControl's), the generation
    stage's and the other stages' rows. While generation is over and a later stage runs, that stage's word
    (SMOKE TEST, TOKENS, MERGING, EXTRACTING); a run that ended DONE says what its exit code says once a
    later stage failed (FAILED, 2) or stopped before its end (STOPPED, 3); else the state itself. Finished:
    generation has ended and no stage runs."""
    rows = tuple(r for r in rows if r.name in STAGE_NAMES)
    states = {r.name: r.state for r in rows} | {"generation": generation}
    running = next((n for n in STAGE_NAMES if states.get(n) == StageState.RUNNING), None)
    finished = running is None and state not in LIVE
    if running is not None and running != "generation" and generation != StageState.RUNNING:
        return RunStanding(STAGE_RUNNING_LABEL.get(running, str(state)), finished)
    weight = weighed(rows)
    if state == RunState.DONE and weight is not None:
        return RunStanding(weight.upper(), finished)
    return RunStanding(str(state), finished)


@dataclass(frozen=True)
class LifeNow:
    """The run's life as a snapshot carries it, read once (the rows and what is decided from them agree)."""
    generation: StageState
    stages: tuple[StageProgress, ...]
    label: str
    finished: bool


class RunLife:
    """The run's one owner: the stages' progress, the generation stage's state, the label, `finished` and
    the exit code, each decided here once; the failure that stopped the run."""

    def __init__(self, control: RunControl, rows: StageRows, redact: Redactor) -> None:
        self.control = control  # generation's state, alert, how it ended (the engine's)
        self.rows = rows        # every other stage's progress
        self._redact = redact
        self.error: DraftgenError | None = None
        self._launched = False                       # the engine's run was started: run requests may have been sent
        self._failure: ExitCode | None = None        # the run stopped on an error (2), a failed smoke test (1), ...
        self._interrupted = False                    # quit before the run started (130)
        self._tokens_complete: bool | None = None    # the tokens stage's report, once the run that was started ended

    # -- what the pipeline tells -------------------------------------------------------------------

    @property
    def launched(self) -> bool:
        """The engine's run was started: run requests may have been sent."""
        return self._launched

    def launch(self) -> None:
        """The engine's run is started (the start-up gate let it): run requests may be sent."""
        self._launched = True

    def fail(self, error: DraftgenError) -> None:
        """The run cannot go on: every stage still running fails with why, generation stops with the
        error's exit code, and the error is kept for the command boundary."""
        self.error = error
        message = self._redact(str(error))
        self.rows.fail_running(message)
        self._stopped(message, error.exit_code)

    def smoke_failed(self, message: str) -> None:
        """The start-up smoke test failed: the run does not start (exit 1)."""
        self._stopped(message, ExitCode.SMOKE_FAILED)

    def not_started(self) -> None:
        """Quit before the run started: no run request was sent (exit 130)."""
        self.control.not_started()
        self._interrupted = True

    def ended(self, *, tokens_complete: bool) -> None:
        """The run that was started is over and its tokens stage reported (False: answers left without
        token ids, for another cause than a full disk)."""
        self._tokens_complete = tokens_complete

    def _stopped(self, message: str, code: ExitCode) -> None:
        self._failure = code
        self.control.fail(message)

    # -- what is decided here, once each ----------------------------------------------------------

    def generation(self) -> StageState:
        """The generation stage's state: idle until launched, then running until generation ends (DONE or
        LIMITED: done; any other final state: stopped) or fails; skipped when the run never started."""
        state = self.control.state
        if not self._launched:
            return StageState.IDLE if state in LIVE else StageState.SKIPPED
        if self._failure is not None:
            return StageState.FAILED
        if state in LIVE:
            return StageState.RUNNING
        return StageState.DONE if state in (RunState.DONE, RunState.LIMITED) else StageState.STOPPED

    def now(self) -> LifeNow:
        """The stages, the generation stage and how the run stands (`standing`), for a snapshot."""
        rows = self.rows.rows()  # read once: a worker thread's report lands before or after, never between
        generation = self.generation()
        stands = standing(self.control.state, generation, rows)
        return LifeNow(generation, rows, stands.label, stands.finished)

    @property
    def exit_code(self) -> ExitCode:
        """The run's exit code (docs/run-end.md). An error, a failed smoke test or a quit before the start is
        its own code. A run that was started: prompts left or records waiting in a spool for the next run
        make it incomplete (3); a refused key is 4; answers left without token ids an error (2). A run
        complete so far is weighed with the other stages (`weighed`, as the label is): one failed is an
        error (2), one stopped before its end incomplete (3)."""
        if self._failure is not None:
            return self._failure
        if self._interrupted:
            return ExitCode.INTERRUPTED
        code = ExitCode.COMPLETE
        if self._tokens_complete is not None:
            held = self.control.held_outcome
            if self.control.state in INCOMPLETE or held.spooled or held.spooled_failures:
                code = ExitCode.INCOMPLETE
            if self.control.key_refused is not None:
                code = ExitCode.KEY_REFUSED
            if not self._tokens_complete and code == ExitCode.COMPLETE:
                code = ExitCode.ERROR
        if code == ExitCode.COMPLETE:
            weight = weighed(self.rows.rows())
            if weight is StageState.FAILED:
                return ExitCode.ERROR
            if weight is StageState.STOPPED:
                return ExitCode.INCOMPLETE
        return code
