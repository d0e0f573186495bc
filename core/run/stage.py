"""What a stage of a run is: `RunStage`, the interface every entry of the registry (registry.py)
implements, and `StageHost`, what a stage is handed when it runs (the Pipeline, core/run/pipeline.py).

A stage declares its name (the name its row, events and snapshot state travel under: one of
core/live/snapshot.py `STAGE_NAMES`), when it runs, whether it is on for a config, its key in the
UI and its headless flag if it has them, the event kind its outcome is told with, and how it runs.
The pipeline, the stages panel's rows, the TUI's keys and the headless printer read these
declarations from the registry; none of them names a stage.
"""

from __future__ import annotations

from collections.abc import Coroutine
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Payload

if TYPE_CHECKING:  # the registry is read by views (the TUI's keys) that never load the engine
    from draftgen.core.config import Config
    from draftgen.core.run.stage_rows import StageRows
    from draftgen.core.run.stages import Stages
    from draftgen.core.rundir import RunDir


class When(StrEnum):
    """Where a stage sits in a run."""
    BEFORE = "before"          # gates generation (the smoke test); also on demand
    GENERATION = "generation"  # the run's requests (core/run/generation.py)
    BESIDE = "beside"          # while generation runs, fed by its answers (the tokens stage)
    AFTER = "after"            # after generation: on demand (a key, a command) or chained (--merge)


class StageHost(Protocol):
    """What a stage reads and runs through: the run's config and run folder, the one-shot runner (the
    stages that run now, the engine), the stages panel's rows (core/run/stage_rows.py: its progress
    goes there) and the run's event sink (redacted, events.log, the views)."""
    config: Config
    rundir: RunDir
    oneshot: Stages
    stages: StageRows

    def emit(self, payload: Payload, /) -> None: ...


class RunStage:
    """One stage of the pipeline. Subclasses set the class attributes and override what differs;
    the defaults are a stage with no key, no flag and nothing to check."""

    name: ClassVar[str]                        # as in snapshot.STAGE_NAMES: its row, state and events
    when: ClassVar[When]
    done: ClassVar[type[Payload] | None] = None  # the event its outcome is told with (a headless milestone)
    key: ClassVar[str | None] = None           # its key in the TUI (the action of the same name), if any
    help: ClassVar[str] = ""                   # what the key does, for the help screen
    flag: ClassVar[str | None] = None          # `draftgen run --headless --<flag>` chains it after generation
    flag_help: ClassVar[str] = ""              # the flag's line in `draftgen run --help`
    steps: ClassVar[tuple[str, ...]] = ()      # declared sub-steps that run inside it (their own config table)

    @property
    def label(self) -> str:
        """The header's word while it runs and generation does not (core/live/snapshot.py)."""
        return snap.STAGE_RUNNING_LABEL.get(self.name, self.name.upper())

    def enabled(self, config: Config) -> bool:
        """Whether the config turns it on (a stage that is off still runs when asked for by hand)."""
        return True

    def unavailable(self, host: StageHost) -> str | None:
        """None when it can start now, else a sentence saying why not (shown to the user)."""
        return None

    def run(self, host: StageHost, **options: Any) -> Coroutine[Any, Any, Any]:
        """The coroutine that runs it once, on demand (a key, a command, a chain after generation)."""
        raise NotImplementedError(f"the {self.name} stage is not started on demand")
