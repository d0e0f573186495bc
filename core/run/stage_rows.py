"""The stages panel's rows (every stage of the registry but generation) and their one owner: `StageRows`.

Every stage's progress is written here and only through its methods: the one-shot stages
(stages.py, whose merge and extraction report from a worker thread), the tokens stage
(tokens_stage.py) and the generation stage's failure (generation.py). A lock makes each change one
step, so a worker thread's report never undoes a stop said on the event loop; the snapshot reads
the rows as one tuple.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from draftgen.core.live import snapshot as snap


class StageRows:
    """Each stage's last progress, by name; every change is a method (safe from a worker thread)."""

    def __init__(self) -> None:
        self._rows: dict[str, snap.StageProgress] = {}
        self._lock = threading.Lock()

    # -- what everyone reads ----------------------------------------------------------------------

    def get(self, name: str) -> snap.StageProgress | None:
        return self._rows.get(name)

    def rows(self) -> tuple[snap.StageProgress, ...]:
        """The rows in run order (snapshot.STAGE_NAMES, the registry's order: core/run/registry.py); a
        stage never started has none, generation has none (it is the datasets panel)."""
        rows = self._rows
        return tuple(rows[n] for n in snap.STAGE_NAMES if n in rows)

    # -- changes ----------------------------------------------------------------------------------

    def set(self, progress: snap.StageProgress) -> None:
        """A stage's new row, as it is (started, failed, its live figures)."""
        with self._lock:
            self._rows[progress.name] = progress

    def start(self, name: str) -> None:
        self.set(snap.StageProgress(name, state=snap.StageState.RUNNING))

    def fail(self, name: str, message: str) -> None:
        self.set(snap.StageProgress(name, state=snap.StageState.FAILED, message=message))

    def stop(self, name: str, why: str) -> None:
        """A stage cancelled by stop now: stopped where it got to, never left running."""
        with self._lock:
            current = self._rows.get(name) or snap.StageProgress(name)
            self._rows[name] = dataclasses.replace(current, state=snap.StageState.STOPPED, rate=0.0, eta_s=None,
                                                   message=why)

    def fail_running(self, message: str) -> None:
        """The run cannot go on: every stage still running is failed, with why."""
        with self._lock:
            for name, row in list(self._rows.items()):
                if row.state == snap.StageState.RUNNING:
                    self._rows[name] = dataclasses.replace(row, state=snap.StageState.FAILED, message=message)

    def reporter(self, name: str) -> Callable[[snap.StageProgress], None]:
        """The progress callback a stage reports through, from any thread: a stage stopped meanwhile
        (cancelled while its thread finishes a step) stays stopped."""
        def report(progress: snap.StageProgress) -> None:
            with self._lock:
                current = self._rows.get(name)
                if current is not None and current.state == snap.StageState.STOPPED:
                    return
                self._rows[name] = progress
        return report
