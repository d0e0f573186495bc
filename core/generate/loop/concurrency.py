"""A dataset's concurrency limit, which adapts (AIMD) to sustained 429s. Read by admission (how many
requests a dataset may have out) and kept by the dataset's live state (dataset_run.py)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class AdaptiveConcurrency:
    """AIMD on sustained 429s: three or more within 2 s that are also at least 5% of the responses
    in those 2 s cut the limit by 30% (at most every 2 s) — a background trickle of 429s at a high
    request rate is not a storm; 5 s without a 429 lets it grow back by 2% of the configured value
    per second."""

    WINDOW_S = 2.0
    MIN_429 = 3
    MIN_SHARE = 0.05

    def __init__(self, configured: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = configured
        self.effective = float(configured)
        self._clock = clock
        self._recent: deque[float] = deque()      # times of 429s in the window
        self._responses: deque[float] = deque()   # times of every response in the window
        self._last_cut = -1e9
        self._last_429 = -1e9

    @property
    def limit(self) -> int:
        return max(1, int(self.effective))

    def _prune(self, now: float) -> None:
        for q in (self._recent, self._responses):
            while q and now - q[0] >= self.WINDOW_S:
                q.popleft()

    def on_response(self) -> None:
        """Any answer or error other than a 429 (the share's denominator)."""
        now = self._clock()
        self._responses.append(now)
        if len(self._responses) > 4096:
            self._prune(now)

    def on_429(self) -> None:
        now = self._clock()
        self._last_429 = now
        self._recent.append(now)
        self._responses.append(now)
        self._prune(now)
        share = len(self._recent) / len(self._responses)
        if len(self._recent) >= self.MIN_429 and share >= self.MIN_SHARE and now - self._last_cut >= 2.0:
            self.effective = max(1.0, self.effective * 0.7)
            self._last_cut = now
            self._recent.clear()

    def tick(self) -> bool:
        """Called every second; True when the limit grew."""
        now = self._clock()
        if self.effective < self.configured and now - self._last_429 >= 5.0:
            self.effective = min(float(self.configured), self.effective + max(1.0, self.configured * 0.02))
            return True
        return False
