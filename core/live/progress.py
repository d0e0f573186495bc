"""How often the one-shot stages (tokens, merge, extract) report progress.

A stage builds a `StageProgress` at most every `PROGRESS_INTERVAL_S` (a `Throttle`), and always
when told (its first and last word); a command-line printer shows fewer still (`every`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from draftgen.core.live.snapshot import StageProgress, StageState

ProgressCallback = Callable[[StageProgress], None]
PROGRESS_INTERVAL_S = 0.25


class Throttle:
    """`due()` is True at most once every `interval_s` seconds, and always when forced."""

    def __init__(self, interval_s: float = PROGRESS_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = -math.inf

    def due(self, force: bool = False) -> bool:
        now = self._clock()
        if not force and now - self._last < self.interval_s:
            return False
        self._last = now
        return True


def every(interval_s: float, show: ProgressCallback) -> ProgressCallback:
    """`show` for a running stage at most every `interval_s`; any other state (done, failed) at once."""
    throttle = Throttle(interval_s)

    def maybe(p: StageProgress) -> None:
        if throttle.due(force=p.state != StageState.RUNNING):
            show(p)
    return maybe
