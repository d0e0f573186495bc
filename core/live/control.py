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
    STAGE = "stage"      # any other stage of the registry (core/run/registry.py), by name: `start_stage`


class Controls(Protocol):
    hub: Hub               # snapshots and events to render
    read_only: bool        # True when attached: every action is disabled

    def unavailable(self, action: Action | str) -> str | None:
        """None when `action` (or a stage of the registry, by name) can run now, else a sentence saying
        why not (shown to the user)."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def start_stage(self, name: str) -> None: ...  # a stage of the registry (core/run/registry.py), started
    def run_smoke(self) -> None: ...      # progress/result: snapshot stage "smoke" (checks), event "smoke_done"
    # stage "merge", event "merge_done"; replace_hidden_states: hidden states of another merge set aside
    def start_merge(self, replace_hidden_states: bool = False) -> None: ...
    # stage "extract" (+ RunSnapshot.gpus), event "extract_done"; on_other_merge: "refuse", "start_over"
    # or "set_aside" for hidden states of another merge (core/extract/claim.py)
    def start_extract(self, on_other_merge: str = "refuse") -> None: ...
    def merge_question(self) -> str | None: ...    # hidden states exist: what to ask before merging, else None
    def extract_question(self) -> str | None: ...  # they belong to another merge: what to ask, else None
    def quit(self, drain: bool) -> None: ...  # drain: finish in-flight requests; else stop now
    def quit_asked(self, asking: bool) -> None: ...  # the quit dialog is open: a run not started waits
    def spool_held(self) -> None: ...     # answers the disk refused go to the spool (spool.py), no wait
