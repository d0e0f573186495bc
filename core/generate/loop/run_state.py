"""The run's state, its gate and how generation ended: `RunControl`.

The state the header shows (RunState), the alert beside it, why the run is held (a hold's kind, its
message and the account condition behind it), who paused it, and the gate every admission and retry
consults (paused, draining, stopping) live here and change only through its methods. The engine
calls them (its control surface, the account watch, the ledger's disk holds); everything else
reads. What each change does to the requests (waking admission, cancelling tasks) stays with the
engine; this class only says whether the change happened.

How generation ended is reported here, as facts: its final state (decided in `end`, the one place,
from what the run left), the line that says it with counts, a refused key (the account watch) and
what became of the records the disk refused (the record book: `HeldOutcome`). The run's end (the
generation stage's state, the label every view shows, the exit code) is decided from these by the
run's one owner, core/run/life.py `RunLife` (docs/run-end.md).

    IDLE --start--> RUNNING <--pause/hold, resume--> PAUSED
    any live state --drain--> DRAINING;  stop(): the gate closes for good (requests abandoned)
    end(datasets) / fail(message) / not_started(): a final state (DONE, STOPPED, DRAINED, WAITING, LIMITED)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventSink
from draftgen.core.live.snapshot import RunState
from draftgen.core.live.stage_payloads import Paused, Resumed
from draftgen.core.live.summary import Counted, ended_line, prompts_left

if TYPE_CHECKING:
    from draftgen.core.generate.api.account import AccountStop

LIVE = (RunState.IDLE, RunState.RUNNING, RunState.PAUSED, RunState.DRAINING)


class Hold(Enum):
    """Why the engine paused the run by itself (a pause by the user holds nothing)."""
    ACCOUNT = "account"    # the key or the account (401, 402 out of credits, 403 a spending limit)
    DISK = "disk"
    MODEL = "model"        # most answers came from another model than the one asked (record_book.py)


class PausedBy(StrEnum):
    """Who paused the run (a hold is the engine's own, with its reason in the alert)."""
    USER = "by the user"          # p, the control socket, SIGUSR1's counterpart
    SMOKE = "for the smoke test"  # a smoke test asked for mid-run; the run resumes when it ends


@dataclass(frozen=True)
class HeldOutcome:
    """What became of the records the disk refused, this run (the end summary says it); RunControl keeps
    it, the record book tells it."""
    written: int = 0           # answers written after being held (the disk took them later)
    spooled: int = 0           # answers spooled (spool.py), at `spool_path`
    spooled_failures: int = 0
    spool_path: str = ""
    lost: int = 0              # answers no place would take (only if the spool failed too)
    imported: int = 0          # spooled answers of an earlier run imported at the start

    def line(self) -> str:
        """What became of the answers the disk refused this run (and those an earlier run spooled)."""
        parts = []
        if self.imported:
            parts.append(f"{self.imported:,} spooled answer(s) of an earlier run imported")
        if self.written:
            parts.append(f"{self.written:,} held answer(s) written once the disk took them")
        if self.spooled or self.spooled_failures:
            parts.append(f"{self.spooled:,} held answer(s) spooled to {self.spool_path} (the next `draftgen run` "
                         "imports them)")
        if self.lost:
            parts.append(f"{self.lost:,} held answer(s) LOST: neither the disk nor a spool place took them "
                         "(the next run asks them again)")
        return "; ".join(parts)



@dataclass(frozen=True)
class ControlView:
    """The run's state as one value (what RunControl.view() returns)."""
    state: RunState
    alert: str
    hold: Hold | None
    paused_by: PausedBy | None  # who paused the run (None: not paused, or held by the engine itself)
    draining: bool
    stopping: bool
    account: AccountStop | None
    ended: str                  # how the run ended, with counts (final states only)
    held_outcome: HeldOutcome   # what became of the records the disk refused


class RunControl:
    """The run's state, its holds and their reasons, the gate and how generation ended; every change is a method."""

    def __init__(self, on_event: EventSink) -> None:
        self._event = on_event
        self._state = RunState.IDLE
        self._alert = ""
        self._hold: Hold | None = None
        self._account: AccountStop | None = None
        self._paused_by: PausedBy | None = None
        self._draining = False
        self._stopping = False
        self._open = asyncio.Event()  # clear while paused or held
        self._open.set()
        # Read several times per request, so plain attributes (a property is a call): `is_open` changes
        # with `_open` (`_set_open`), `closed` with `_draining`; read them, never set them.
        self.is_open = True   # admission may go on (not paused, not held): `_open` is set
        self.closed = False   # a drain or a stop began
        self._closing = asyncio.Event()  # set at a drain or a stop: a retry's wait ends there
        # How generation ended (reported by those who see it; the run's owner, core/run/life.py, decides from it).
        self._ended = ""                         # how the run ended, with counts (final states only)
        self._key_refused: AccountStop | None = None  # a 401 drained the run
        self._held_outcome = HeldOutcome()

    # -- what everyone reads ----------------------------------------------------------------------

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def alert(self) -> str:
        return self._alert

    @property
    def current_hold(self) -> Hold | None:
        """Why the engine paused the run by itself, while it is paused."""
        return self._hold

    @property
    def paused_by(self) -> PausedBy | None:
        """Who paused the run, while it is paused by someone (a hold is in `current_hold`)."""
        return self._paused_by

    @property
    def account(self) -> AccountStop | None:
        """The account condition holding the run, while it does."""
        return self._account

    @property
    def paused(self) -> bool:
        return self._state == RunState.PAUSED

    @property
    def draining(self) -> bool:
        """Admit nothing more; requests in flight finish."""
        return self._draining

    @property
    def stopping(self) -> bool:
        """Requests in flight are abandoned."""
        return self._stopping

    def _set_open(self, now: bool) -> None:
        """`_open` and the `is_open` read on every request, changed together (here only)."""
        if now:
            self._open.set()
        else:
            self._open.clear()
        self.is_open = now

    async def wait_open(self) -> None:
        await self._open.wait()

    async def wait_closed(self) -> None:
        """Until a drain or a stop begins."""
        await self._closing.wait()

    @property
    def ended(self) -> str:
        """How the run ended, with counts (final states only; empty before, and for a run never started)."""
        return self._ended

    @property
    def key_refused(self) -> AccountStop | None:
        """The 401 that drained the run."""
        return self._key_refused

    @property
    def held_outcome(self) -> HeldOutcome:
        """What became of the records the disk refused this run (and those an earlier run spooled)."""
        return self._held_outcome

    def view(self) -> ControlView:
        return ControlView(self._state, self._alert, self._hold, self._paused_by, self._draining, self._stopping,
                           self._account, self._ended, self._held_outcome)

    # -- changes ----------------------------------------------------------------------------------

    def start(self) -> None:
        """The run opened what it needs: IDLE becomes RUNNING (a drain or stop asked before stays)."""
        if self._state == RunState.IDLE:
            self._state = RunState.RUNNING

    def pause(self, by: PausedBy) -> bool:
        """Pause a running run; True when it was running."""
        if self._state != RunState.RUNNING:
            return False
        self._state = RunState.PAUSED
        self._paused_by = by
        self._set_open(False)
        self._event(Paused(by=by))
        return True

    def hold(self, why: Hold, reason: str, account: AccountStop | None = None) -> None:
        """The engine pauses the run by itself (out of credits, a write the disk refused); the reason
        is the alert, said once while it stays the same."""
        first = self._alert != reason
        self._alert = reason
        self._hold = why
        if account is not None:
            self._account = account
        if self._state == RunState.RUNNING:
            self._state = RunState.PAUSED
            self._set_open(False)
        if first:
            self._event(ev.Alert(alert=reason))

    def say(self, alert: str) -> None:
        """An alert with no change of state (a key refused before the drain, a balance re-read)."""
        self._alert = alert

    def release(self, why: Hold) -> None:
        """The hold `why` no longer applies (the records the disk refused are written, spooled or said
        lost): its alert goes, so nothing says the run is still held by it; the state is unchanged."""
        if self._hold is why:
            self._alert = ""
            self._hold = None

    def resume(self) -> None:
        """Running again: the holds, their reasons and who paused are cleared, the gate opens."""
        self._state = RunState.RUNNING
        self._alert = ""
        self._hold = None
        self._account = None
        self._paused_by = None
        self._set_open(True)
        self._event(Resumed())

    def drain(self) -> bool:
        """Admit nothing more; True when this call began the drain."""
        if self._state in (RunState.DONE, RunState.STOPPED) or self._draining:
            return False
        self._draining = True
        self._state = RunState.DRAINING
        self._set_open(True)  # what waits for a resume wakes and sees the drain
        self.closed = True
        self._closing.set()
        return True

    def stop(self) -> bool:
        """Stop now; True when this call began it (the engine abandons the requests in flight)."""
        if self._stopping:
            return False
        self._stopping = True
        self._draining = True
        self._set_open(True)
        self.closed = True
        self._closing.set()
        return True

    def fail(self, message: str) -> None:
        """The run cannot go on (or will not start): STOPPED, with why as the alert (its exit code and the
        generation stage's state are the run's owner's: core/run/life.py)."""
        self._alert = message
        self._state = RunState.STOPPED

    def end(self, datasets: Iterable[Counted], *, money_limited: bool = False) -> RunState:
        """The run that was started is over: how generation ended, decided here and only here, and the line
        that says it with counts (summary.py ended_line). DONE only when no prompt is left to ask, LIMITED
        when max_usd skipped some; with prompts left, WAITING when an account condition held admission,
        else STOPPED (stop now), DRAINED (a drain) or STOPPED (a dataset stopped by its routing, 404 no
        endpoints). Returns the final state."""
        ds = tuple(datasets)
        if prompts_left(ds) == 0:
            final = RunState.LIMITED if money_limited else RunState.DONE
        elif self._hold is Hold.ACCOUNT:
            final = RunState.WAITING
        elif self._stopping:
            final = RunState.STOPPED
        elif self._draining:
            final = RunState.DRAINED
        else:
            final = RunState.STOPPED  # a dataset stopped by its routing (404 no endpoints) left prompts
        self._state = final
        self._ended = ended_line(final, ds)
        return final

    def not_started(self) -> None:
        """Quit before the run started: STOPPED, with no ended line (no run request was sent)."""
        self._state = RunState.STOPPED
        self._ended = ""

    # -- how generation ended, as those who see it tell it ------------------------------------------

    def refuse_key(self, stop: AccountStop) -> bool:
        """A 401: True the first time (the engine then drains the run)."""
        if self._key_refused is not None:
            return False
        self._key_refused = stop
        return True

    def held_written(self) -> None:
        """A held answer was written once the disk took it."""
        self._held_outcome = dataclasses.replace(self._held_outcome, written=self._held_outcome.written + 1)

    def held_spooled(self, answers: int, failures: int, path: str) -> None:
        """The records still held at the end were spooled to `path` (the next run imports them)."""
        out = self._held_outcome
        self._held_outcome = dataclasses.replace(out, spooled=out.spooled + answers,
                                                 spooled_failures=out.spooled_failures + failures, spool_path=path)

    def held_lost(self, answers: int) -> None:
        """Held answers neither the disk nor a spool place took."""
        self._held_outcome = dataclasses.replace(self._held_outcome, lost=self._held_outcome.lost + answers)

    def spool_imported(self) -> None:
        """An answer an earlier run spooled was imported as its dataset opened."""
        self._held_outcome = dataclasses.replace(self._held_outcome, imported=self._held_outcome.imported + 1)
