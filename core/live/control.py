"""The control surface: the only way a view changes a run.

The TUI holds an object with this shape: the live `Pipeline` (core/run/pipeline.py) when it embeds
the engine, or a read-only viewer when attached, whose methods do nothing and whose
`unavailable()` says why. Stage progress and results arrive through snapshots and events only.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from draftgen.core.live.hub import Hub


class Action(StrEnum):
    """What a view may ask of a run through `Controls` (quit and spooling have their own methods)."""
    PAUSE = "pause"
    RESUME = "resume"
    SMOKE = "smoke"
    MERGE = "merge"
    EXTRACT = "extract"


class Controls(Protocol):
    hub: Hub               # snapshots and events to render
    read_only: bool        # True when attached: every action is disabled

    def unavailable(self, action: Action) -> str | None:
        """None when `action` can run now, else a sentence saying why not (shown to the user)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def run_smoke(self) -> None: ...      # progress/result: snapshot stage "smoke" (checks), event "smoke_done"
    def start_merge(self) -> None: ...    # stage "merge", event "merge_done"
    def start_extract(self) -> None: ...  # stage "extract" (+ RunSnapshot.gpus), event "extract_done"
    def quit(self, drain: bool) -> None: ...  # drain: finish in-flight requests; else stop now
    def quit_asked(self, asking: bool) -> None: ...  # the quit dialog is open: a run not started waits
    def spool_held(self) -> None: ...     # answers the disk refused go to the spool (spool.py), no wait
