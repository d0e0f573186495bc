"""A dataset's concurrency limit, which adapts (AIMD) to 429 storms. Read by admission (how many
requests a dataset may have out) and kept by the dataset's live state (dataset_run.py)."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from draftgen.core.live.payloads import Concurrency


class AdaptiveConcurrency:
    """AIMD on 429 storms, told from a trickle by a rate over a window with a minimum count.

    A storm: in the last 5 s, at least 5 429s that are also at least 5% of the attempts sent in those 5 s, each 429
    counted at the time its attempt was sent. A storm cuts the limit by 30% (at most every 2 s). The share is of the
    attempts sent, not of the responses: a 429 comes back at once while an answer takes its latency, so at a run's
    start (2,000 sent, none answered yet) a 1% trickle would be 100% of the responses. A steady 1% trickle at 2,000
    in flight (about 100 attempts a second: 5 of 500 in a window) never reaches 5%. The storm ends 5 s after the
    last 429 that met the rule; from then the limit grows back by 2% of the configured value per second, whatever
    trickle goes on.

    `on_change(event)` is told of each storm's start with its cut, its end (its 429s, its cuts, the
    lowest limit) and the limit back at the configured value, each a `Concurrency` payload (its figures,
    no dataset: the caller names whose limit it is): a storm is a few lines, not one per 429 or per cut."""

    WINDOW_S = 5.0
    MIN_429 = 5
    MIN_SHARE = 0.05
    CUT_EVERY_S = 2.0
    QUIET_S = 5.0  # without a storm-level share, the storm is over and the limit grows back

    def __init__(self, configured: int, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[Concurrency], None] | None = None) -> None:
        self.configured = configured
        self.effective = float(configured)  # set by `_set`, which keeps `limit`
        self.limit = max(1, configured)  # requests the dataset may have out: read per request, so an attribute
        self._clock = clock
        self._on_change = on_change
        self._recent: deque[float] = deque()  # times of 429s in the window
        self._sent: deque[float] = deque()    # times of every attempt sent in the window
        self._last_cut = -1e9
        self._last_storm = -1e9  # the last 429 that met the storm rule
        self._storm: _Storm | None = None  # the storm going on (None: none)

    def _set(self, effective: float) -> None:
        self.effective = effective
        self.limit = max(1, int(effective))

    @property
    def in_storm(self) -> bool:
        return self._storm is not None

    def _prune(self, now: float) -> None:
        for q in (self._recent, self._sent):
            while q and now - q[0] >= self.WINDOW_S:
                q.popleft()

    def on_send(self) -> float:
        """An attempt sent (the share's denominator); returns its time, for `on_429(sent_at)`."""
        now = self._clock()
        self._sent.append(now)
        if len(self._sent) > 8192:
            self._prune(now)
        return now

    def on_429(self, sent_at: float | None = None) -> None:
        """A 429 (or what slows down as one: the in-flight-budget 402, a self-hosted server's 503) to the
        attempt sent at `sent_at` (`on_send`'s time; None: now). It counts at its attempt's time, among the
        attempts sent then: a burst of 2,000 whose 1% of 429s come back over several seconds (a loaded
        server, a slow network) is 1% of the attempts sent in their window, not 20 429s in a window that
        holds the few sent after the burst."""
        now = self._clock()
        at = now if sent_at is None else sent_at
        if not self._recent or at >= self._recent[-1]:
            self._recent.append(at)
        else:
            bisect.insort(self._recent, at)  # a 429 slower than a later one: the window stays in order
        self._prune(now)
        n = len(self._recent)
        sent = max(len(self._sent), n)
        if self._storm is not None:
            self._storm.rate_limited += 1
        if n < self.MIN_429 or n / sent < self.MIN_SHARE:
            return
        self._last_storm = now
        if self._storm is None:
            self._storm = _Storm(now, self.limit, n)
        if now - self._last_cut < self.CUT_EVERY_S:
            return
        before = self.limit
        self._set(max(1.0, self.effective * 0.7))
        self._last_cut = now
        storm = self._storm
        storm.cuts += 1
        storm.lowest = min(storm.lowest, self.limit)
        if storm.cuts == 1:
            self._say(Concurrency(reason="storm", before=before, after=self.limit, configured=self.configured,
                                  rate_limited=n, sent=sent, window_s=self.WINDOW_S, min_rate_limited=self.MIN_429,
                                  min_share=self.MIN_SHARE, cut_every_s=self.CUT_EVERY_S))

    def tick(self) -> bool:
        """Called every second; True when the limit grew."""
        now = self._clock()
        if now - self._last_storm < self.QUIET_S:
            return False
        if (storm := self._storm) is not None:
            self._storm = None
            self._say(Concurrency(reason="over", before=storm.began_at, after=storm.lowest, configured=self.configured,
                                  rate_limited=storm.rate_limited, lasted_s=self._last_storm - storm.start,
                                  cuts=storm.cuts))
        if self.effective < self.configured:
            before = self.limit
            self._set(min(float(self.configured), self.effective + max(1.0, self.configured * 0.02)))
            if self.effective >= self.configured:
                self._say(Concurrency(reason="back", before=before, after=self.limit, configured=self.configured))
            return True
        return False

    def _say(self, change: Concurrency) -> None:
        if self._on_change is not None:
            self._on_change(change)


class _Storm:
    """A storm going on: when it began and the limit then, the 429s in it, its cuts and the lowest limit
    they left."""
    __slots__ = ("start", "began_at", "rate_limited", "cuts", "lowest")

    def __init__(self, start: float, limit: int, rate_limited: int) -> None:
        self.start = start
        self.began_at = limit
        self.rate_limited = rate_limited
        self.cuts = 0
        self.lowest = limit
