"""The one registry of a run's stages, in the order a run goes through them: `REGISTRY`.

The pipeline (what may start, what runs on demand), the stages panel's rows (stage_rows.py, in
snapshot.STAGE_NAMES's order, which test_registry checks is this one), the TUI's keys (tui/app.py,
tui/keys.py) and the headless printer (its milestones, the stages `--<flag>` chains after
generation) iterate it. Adding a stage is its module (a `RunStage`, core/run/stage.py) and its entry
here; its name, header word and finishing command are one line of core/live/snapshot.py's
vocabulary, which travels to attached viewers.

The contamination filter (core/merge/contamination.py) is a declared step of merge, not a stage: it
reads merge's input in merge's one pass and writes into the merged/ that merge replaces whole, so a
filter run on its own would need an output of its own between the two, and a merged/ without it
could be trained on.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from draftgen.core.live.events import Payload
from draftgen.core.live.stage_payloads import ExtractDone, MergeDone, RunDone, SmokeDone, TokensDone
from draftgen.core.run.stage import RunStage, StageHost, When

if TYPE_CHECKING:
    from draftgen.core.config import Config


class _Smoke(RunStage):
    name = "smoke"
    when = When.BEFORE
    done = SmokeDone
    key = "s"
    help = ("smoke test: one request per dataset with the exact run parameters, checked field by field;"
            " the run is paused while it runs")

    def run(self, host: StageHost, **options: Any) -> Coroutine[Any, Any, Any]:
        return host.oneshot.smoke()


class _Generation(RunStage):
    """The run's requests: started once by the pipeline (core/run/generation.py), never on demand."""
    name = "generation"
    when = When.GENERATION
    done = RunDone


class _Tokens(RunStage):
    """Token ids as answers land (core/run/tokens_stage.py); `draftgen tokens` outside a run."""
    name = "tokens"
    when = When.BESIDE
    done = TokensDone

    def enabled(self, config: Config) -> bool:
        return config.engine.reconstruct


class _Merge(RunStage):
    name = "merge"
    when = When.AFTER
    done = MergeDone
    key = "m"
    help = "merge: all datasets into one deduplicated, shuffled training set (merged/)"
    flag = "merge"
    flag_help = "headless: merge when generation is done"
    steps = ("contamination",)  # [merge] exclude, exclude_files: core/merge/contamination.py

    def unavailable(self, host: StageHost) -> str | None:
        if not any(host.rundir.responses(d.name).exists() for d in host.config.datasets):
            return "nothing to merge yet: no answers on disk"
        if host.oneshot.running("extract"):
            return "extraction is running: a merge now would change merged/ under it"
        return None

    def run(self, host: StageHost, **options: Any) -> Coroutine[Any, Any, Any]:
        return host.oneshot.merge(**options)


class _Extract(RunStage):
    name = "extract"
    when = When.AFTER
    done = ExtractDone
    key = "x"
    help = "extract: run the target model over merged/ and write hidden states (GPU panel)"
    flag = "extract"
    flag_help = "headless: extract after merging"

    def unavailable(self, host: StageHost) -> str | None:
        if not host.config.extract.model:
            return f"no model to extract with: set [extract] model in {host.config.path}"
        if not (host.rundir.merged / "tokens" / "index.jsonl").exists():
            return "no merged set yet: press m to merge first"
        if host.oneshot.running("merge"):
            return "merge is still running"
        return None

    def run(self, host: StageHost, **options: Any) -> Coroutine[Any, Any, Any]:
        return host.oneshot.extract(**options)


REGISTRY: tuple[RunStage, ...] = (_Smoke(), _Generation(), _Tokens(), _Merge(), _Extract())


def stage(name: str) -> RunStage:
    """The registry's entry of that name (KeyError for a name it does not hold)."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise KeyError(name)


def keyed() -> tuple[RunStage, ...]:
    """The stages a key starts in the TUI, in run order."""
    return tuple(s for s in REGISTRY if s.key)


def chained() -> tuple[RunStage, ...]:
    """The stages `draftgen run --headless --<flag>` (and the demo) may run after generation, in order."""
    return tuple(s for s in REGISTRY if s.flag and s.when is When.AFTER)


def milestones() -> tuple[type[Payload], ...]:
    """The payload types the stages tell their outcome with (the headless printer shows them)."""
    return tuple(s.done for s in REGISTRY if s.done is not None)
