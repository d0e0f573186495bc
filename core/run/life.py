"""The run's life and its one owner: `RunLife`, built once per run by the pipeline.

Generation's own state, its alert, ended line and exit code are kept by the engine's `RunControl`
(core/generate/loop/run_state.py); every other stage's progress by `StageRows` (stage_rows.py). How
the run ended is decided here from the two: the exit code weighs the stages after the smoke test
with snapshot.weighed, the one rule the header's label (`RunSnapshot.label`) reads too, so the word
a view shows and the code the shell gets never disagree. The error that stopped the run is kept
here for the command boundary to print.
"""

from __future__ import annotations

from draftgen.core.errors import DraftgenError, ExitCode
from draftgen.core.generate.loop.run_state import RunControl
from draftgen.core.run.stage_rows import StageRows
from draftgen.core.secrets import Redactor


class RunLife:
    """How the run ends, decided once: its exit code, and the failure that stopped it."""

    def __init__(self, control: RunControl, rows: StageRows, redact: Redactor) -> None:
        self.control = control  # generation's state, alert, ended line and code (the engine's)
        self.rows = rows        # every other stage's progress
        self._redact = redact
        self.error: DraftgenError | None = None

    @property
    def exit_code(self) -> ExitCode:
        """The run's exit code (docs/run-end.md): RunControl's, with the stages after the smoke test
        weighed (snapshot.weighed: one failed is an error (2), one stopped before its end incomplete (3))."""
        return self.control.exit_code(self.rows.states(but="smoke"))

    def fail(self, error: DraftgenError) -> None:
        """The run cannot go on: every stage still running fails with why, generation stops with the
        error's exit code, and the error is kept for the command boundary."""
        self.error = error
        message = self._redact(str(error))
        self.rows.fail_running(message)
        self.control.fail(message, error.exit_code)
