"""The tokens stage while the run goes: each answer turned into token ids as it lands
(core/tokens/during_run.py), its progress told to the stages panel's rows (stage_rows.py), and its report
when the run ends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftgen.core.config import Config
from draftgen.core.live import payloads as ev
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import EventSink, Level
from draftgen.core.live.stage_payloads import TokensDone, TokensFailed
from draftgen.core.quoting import sh_path
from draftgen.core.records import ResponseLine
from draftgen.core.run.stage_rows import StageRows
from draftgen.core.rundir import RunDir

if TYPE_CHECKING:  # imported when the stage starts: a run without reconstruction never loads it
    from draftgen.core.tokens.during_run import RunReconstructor


class TokensStage:
    """The live reconstructor of one run, from its start to its report."""

    def __init__(self, config: Config, emit: EventSink, rows: StageRows, rundir: RunDir) -> None:
        self._config = config
        self._rundir = rundir  # the run's one RunDir, handed to the reconstructor
        self._emit = emit
        self._rows = rows  # the stages panel's rows: this class only tells them
        self._reconstructor: RunReconstructor | None = None
        self.fidelity: tuple[snap.ProviderFidelity, ...] = ()  # the last figures, kept after the workers stop

    async def start(self) -> None:
        from draftgen.core.tokens.during_run import RunReconstructor
        self._reconstructor = RunReconstructor(self._config, workers=self._config.engine.workers, on_event=self._emit,
                                               rundir=self._rundir)
        await self._reconstructor.start()
        for ds in self._config.datasets:
            await self._reconstructor.catch_up(ds.name)

    def submit(self, dataset: str, record: ResponseLine) -> None:
        if self._reconstructor is not None:
            self._reconstructor.submit(dataset, record)

    def refresh(self) -> None:
        """The stage's row and the fidelity figures, while it runs."""
        if self._reconstructor is not None:
            self._rows.set(self._reconstructor.progress())
            self.fidelity = self._reconstructor.fidelity()

    async def finish(self, imported: bool = False) -> bool:
        """The run is over: wait for the last answers, say the report; False when some answer has no
        token ids for a reason other than a full disk (the stage then stops, saying what could not be
        written and what finishes it). `imported`: answers an earlier run spooled were written as the
        datasets opened, after `start` caught up with the disk: they are caught up with now (every
        other answer of the run comes through `submit`)."""
        r = self._reconstructor
        if r is None:
            return True
        if imported:
            for ds in self._config.datasets:
                await r.catch_up(ds.name)
        await r.close()
        tokens = r.progress()
        self._rows.set(tokens)
        self.fidelity = r.fidelity()
        self._emit(TokensDone(summary=r.report(None).summary_line()))
        complete = tokens.done >= tokens.total
        if tokens.state == snap.StageState.STOPPED:  # the disk refused: nothing is wrong, it did not finish
            self._emit(TokensFailed(cause=tokens.message, done=tokens.done, total=tokens.total, stopped=True,
                                    at=Level.WARN))
            complete = True  # the stage's STOPPED state makes the run incomplete (exit 3), not an error
        elif not complete:  # the tokens stage failed: not a complete run, merge would drop them
            self._emit(TokensFailed(cause=tokens.message, done=tokens.done, total=tokens.total,
                                    config=sh_path(self._config.path)))
        for row in self.fidelity:
            if row.flagged:
                self._emit(ev.ProviderFlagged(provider=row.name, cause=row.flagged))
        self._reconstructor = None
        return complete

    async def close(self) -> None:
        if self._reconstructor is not None:
            await self._reconstructor.close()
            self._reconstructor = None
