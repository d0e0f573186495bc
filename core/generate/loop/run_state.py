"""The run's state and its one owner: `RunControl`.

The state the header shows (RunState), the alert beside it, why the run is held (a hold's kind, its
message and the account condition behind it), who paused it, and the gate every admission and retry
consults (paused, draining, stopping) live here and change only through its methods. The engine
calls them (its control surface, the account watch, the ledger's disk holds); everything else
reads. What each change does to the requests (waking admission, cancelling tasks) stays with the
engine; this class only says whether the change happened.

    IDLE --start--> RUNNING <--pause/hold, resume--> PAUSED
    any live state --drain--> DRAINING;  stop(): the gate closes for good (requests abandoned)
    end(final) / fail(message): a final state (DONE, STOPPED, DRAINED, WAITING, LIMITED)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

from draftgen.core.live.snapshot import EventKind, EventSink, Level, RunState

if TYPE_CHECKING:
    from draftgen.core.generate.api.account import AccountStop

LIVE = (RunState.IDLE, RunState.RUNNING, RunState.PAUSED, RunState.DRAINING)


class Hold(Enum):
    """Why the engine paused the run by itself (a pause by the user holds nothing)."""
    ACCOUNT = "account"    # the key or the account (401, 402 out of credits, 403 a spending limit)
    DISK = "disk"


class PausedBy(StrEnum):
    """Who paused the run (a hold is the engine's own, with its reason in the alert)."""
    USER = "by the user"          # p, the control socket, SIGUSR1's counterpart
    SMOKE = "for the smoke test"  # a smoke test asked for mid-run; the run resumes when it ends


@dataclass(frozen=True)
class ControlView:
    """The run's state as one value (what RunControl.view() returns)."""
    state: RunState
    alert: str
    held: Hold | None
    paused_by: PausedBy | None  # who paused the run (None: not paused, or held by the engine itself)
    draining: bool
    stopping: bool
    account: AccountStop | None


class RunControl:
    """The run's state, its holds and their reasons, and the gate; every change is a method."""

    def __init__(self, on_event: EventSink) -> None:
        self._event = on_event
        self._state = RunState.IDLE
        self._alert = ""
        self._held: Hold | None = None
        self._account: AccountStop | None = None
        self._paused_by: PausedBy | None = None
        self._draining = False
        self._stopping = False
        self._open = asyncio.Event()  # clear while paused or held
        self._open.set()

    # -- what everyone reads ----------------------------------------------------------------------

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def alert(self) -> str:
        return self._alert

    @property
    def held(self) -> Hold | None:
        """Why the engine paused the run by itself, while it is paused."""
        return self._held

    @property
    def paused_by(self) -> PausedBy | None:
        """Who paused the run, while it is paused by someone (a hold is in `held`)."""
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

    @property
    def closed(self) -> bool:
        return self._draining or self._stopping

    @property
    def is_open(self) -> bool:
        """Admission may go on (not paused, not held)."""
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def view(self) -> ControlView:
        return ControlView(self._state, self._alert, self._held, self._paused_by, self._draining, self._stopping,
                           self._account)

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
        self._open.clear()
        self._event(Level.INFO, EventKind.PAUSED, f"paused {by} "
                    "(requests in flight finish and are recorded)")
        return True

    def hold(self, why: Hold, reason: str, account: AccountStop | None = None) -> None:
        """The engine pauses the run by itself (out of credits, a write the disk refused); the reason
        is the alert, said once while it stays the same."""
        first = self._alert != reason
        self._alert = reason
        self._held = why
        if account is not None:
            self._account = account
        if self._state == RunState.RUNNING:
            self._state = RunState.PAUSED
            self._open.clear()
        if first:
            self._event(Level.ERROR, EventKind.ALERT, reason)

    def say(self, alert: str) -> None:
        """An alert with no change of state (a key refused before the drain, a balance re-read)."""
        self._alert = alert

    def release(self, why: Hold) -> None:
        """The hold `why` no longer applies (the records the disk refused are written, spooled or said
        lost): its alert goes, so nothing says the run is still held by it; the state is unchanged."""
        if self._held is why:
            self._alert = ""
            self._held = None

    def resume(self) -> None:
        """Running again: the holds, their reasons and who paused are cleared, the gate opens."""
        self._state = RunState.RUNNING
        self._alert = ""
        self._held = None
        self._account = None
        self._paused_by = None
        self._open.set()
        self._event(Level.INFO, EventKind.RESUMED, "resumed")

    def drain(self) -> bool:
        """Admit nothing more; True when this call began the drain."""
        if self._state in (RunState.DONE, RunState.STOPPED) or self._draining:
            return False
        self._draining = True
        self._state = RunState.DRAINING
        self._open.set()  # what waits for a resume wakes and sees the drain
        return True

    def stop(self) -> bool:
        """Stop now; True when this call began it (the engine abandons the requests in flight)."""
        if self._stopping:
            return False
        self._stopping = True
        self._draining = True
        self._open.set()
        return True

    def fail(self, message: str) -> None:
        """The run cannot go on (or will not start): STOPPED, with why as the alert."""
        self._alert = message
        self._state = RunState.STOPPED

    def end(self, final: RunState) -> None:
        """The run is over: its final state (summary.py final_state, or STOPPED before it started)."""
        assert final not in LIVE, f"{final} is not a final state"
        self._state = final
