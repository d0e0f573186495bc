"""Counters for the throughput panel: a recent window and the whole run, labelled as such."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable


class RateTracker:
    """Answers and completion tokens per second over the last `window_s` and since `start`."""

    def __init__(self, window_s: float = 30.0, history_s: int = 60, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._history_s = history_s
        self._clock = clock
        self.start = clock()
        self.answers = 0
        self.tokens = 0
        self._buckets: deque[list[float]] = deque()  # [second, answers, tokens]

    def record(self, completion_tokens: int) -> None:
        self.answers += 1
        self.tokens += completion_tokens
        sec = int(self._clock())
        buckets = self._buckets
        if buckets and (bucket := buckets[-1])[0] == sec:  # once per answer: the second's bucket looked up once
            bucket[1] += 1
            bucket[2] += completion_tokens
        else:
            buckets.append([sec, 1, completion_tokens])
            horizon = sec - max(self._history_s, self.window_s) - 1
            while buckets and buckets[0][0] < horizon:
                buckets.popleft()

    def window(self) -> tuple[float, float, float]:
        """(answers/s, tokens/s, mean completion tokens) over the recent window."""
        now = self._clock()
        span = min(self.window_s, max(now - self.start, 1e-9))
        cutoff = now - self.window_s
        answers = tokens = 0.0
        for sec, a, t in reversed(self._buckets):
            if sec < cutoff:
                break
            answers += a
            tokens += t
        return answers / span, tokens / span, (tokens / answers if answers else 0.0)

    def total(self) -> tuple[float, float, float]:
        span = max(self._clock() - self.start, 1e-9)
        return self.answers / span, self.tokens / span, (self.tokens / self.answers if self.answers else 0.0)

    def history(self) -> tuple[float, ...]:
        """Answers per second for each of the last `history_s` whole seconds, oldest first."""
        now = int(self._clock())
        by_sec = {int(b[0]): b[1] for b in self._buckets}
        return tuple(float(by_sec.get(s, 0)) for s in range(now - self._history_s, now))


class Tally:
    """Counts by key, most frequent first in snapshots."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        self._counts[key] += n

    def items(self) -> tuple[tuple[str, int], ...]:
        return tuple(self._counts.most_common())

    def __getitem__(self, key: str) -> int:
        return self._counts[key]
