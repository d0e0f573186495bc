"""One timer for the deadline of every request in flight (`api.request_timeout_s`).

aiohttp's `ClientTimeout(total=...)` arms a timer per request and enters a timer context around each
read: about as much CPU per request as the engine's own bookkeeping (benchmarks/bench_engine.py). The
requests of a client all have the same timeout, so the order they started in is the order their
deadlines come in: one sweep, `SWEEP_S` apart (or a quarter of the timeout when that is shorter), cancels
the requests past theirs, from the oldest, and stops at the first one that is not. A request hears
`TimeoutError` at the await it was in, as from `asyncio.timeout()` (the same `cancel`/`uncancel`
bookkeeping: a stop that cancelled the task as well is not turned into a timeout). A deadline is met
at most one sweep late, as aiohttp's own rounds a timeout of 5 s or more up to the next whole second.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

SWEEP_S = 1.0


class Deadlines:
    """`with deadlines:` bounds the awaits inside it to `timeout_s` (TimeoutError past it). A task is
    inside at most once at a time (a request's exchange); a plain context manager, so entering costs
    two calls, not two coroutines. One thread's loop at a time enters it (its client's)."""

    def __init__(self, timeout_s: float, every_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self._every = min(SWEEP_S, timeout_s / 4) if every_s is None else every_s
        self._due: dict[asyncio.Task[Any], tuple[float, int]] = {}  # task -> (deadline, its cancels at entry)
        self._expired: set[asyncio.Task[Any]] = set()  # cancelled by a sweep, not out yet
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the sweep's

    def __enter__(self) -> None:
        # The requests of a client run on one loop, the sweep's: the current task is looked up on it, where
        # asyncio.current_task() first asks which loop runs (on Python 3.11 a getpid() call each time).
        loop = self._loop
        if loop is None or (task := asyncio.current_task(loop)) is None:
            # the first request, or one on a new loop (a client used again by a later run)
            task = asyncio.current_task()
            assert task is not None, "a request's exchange runs in a task"
            loop = task.get_loop()
        self._due[task] = (loop.time() + self.timeout_s, task.cancelling())
        if self._sweep is None or self._loop is not loop:
            self._loop = loop
            self._sweep = loop.call_later(self._every, self._swept)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        task = asyncio.current_task(self._loop)  # the loop `__enter__` found (see there)
        if task is None:  # another loop entered meanwhile (one loop at a time runs a thread)
            task = asyncio.current_task()
        assert task is not None
        _, cancelling = self._due.pop(task)
        if self._expired and task in self._expired:
            self._expired.discard(task)
            # Ours alone (no stop cancelled the task too): the cancel is taken back, a timeout raised.
            if task.uncancel() <= cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def sweep(self) -> int:
        """Cancel the requests past their deadline (each once); how many were cancelled just now."""
        assert self._loop is not None
        now = self._loop.time()
        late = 0
        for task, (deadline, _) in self._due.items():  # oldest first: deadlines in the order they come
            if deadline > now:
                break
            if task not in self._expired and not task.done():
                self._expired.add(task)
                task.cancel()
                late += 1
        return late

    def _swept(self) -> None:
        assert self._loop is not None
        try:
            self.sweep()
        finally:  # the next sweep, whatever this one met
            self._sweep = self._loop.call_later(self._every, self._swept) if self._due else None

    @property
    def armed(self) -> bool:
        """A sweep is scheduled (while requests are in flight, and one sweep after)."""
        return self._sweep is not None
