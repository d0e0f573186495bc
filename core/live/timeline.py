"""The run's history: requests/s, completion tokens/s, spend per minute, error rate and requests in
flight over the whole run, for the history view, attach and `draftgen report`.

Once per `interval_s` the recorder takes this process's running totals, appends the interval's
deltas to `history.jsonl` in the run directory, and adds a point to a bounded series: when it
holds `capacity` points, neighbours are merged in pairs and the resolution halves, so a week-long
run costs the same memory as a minute-long one. A resumed run reads the file first, so the
history spans every run of the directory.

history.jsonl, one object per interval (appended and flushed; a torn last line is skipped):

    {"ts": 1767261600.0, "run": 1767261590.2, "dt": 5.0, "answers": 17, "tokens": 90304,
     "usd": 0.1343, "errors": 2, "in_flight": 460}

`ts` is the wall clock at the interval's start, `run` the wall-clock start of the run (process)
that wrote it, `dt` the interval in seconds. Durations come from the monotonic clock: `ts` is the
run's wall-clock start plus monotonic time since, so a clock stepped back or forth (NTP, a VM
resumed) never makes an interval negative or a day long; `answers`, `tokens` (completion tokens), `usd`
(billed spend) and `errors` (failed attempts, retried or not; truncated answers excluded) count
what happened during it; `in_flight` is the number in flight at its end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from draftgen.core.files import FILE_MODE
from draftgen.core.live.snapshot import Timeline


@dataclass(frozen=True)
class Totals:
    """Running totals of this process (never counts from earlier runs: those would look like a burst)."""
    answers: int
    tokens: int
    usd: float
    errors: int
    in_flight: int


@dataclass(frozen=True)
class Interval:
    ts: float
    run: float
    dt: float
    answers: int
    tokens: int
    usd: float
    errors: int
    in_flight: int

    def point(self) -> tuple[float, ...]:
        dt = max(self.dt, 1e-9)
        tried = self.answers + self.errors
        return (round(self.ts, 3), round(self.answers / dt, 4), round(self.tokens / dt, 2),
                round(self.usd / dt * 60, 6), round(100 * self.errors / tried, 3) if tried else 0.0,
                float(self.in_flight))


def read_history(path: Path) -> Iterator[Interval]:
    """The intervals in a history.jsonl, skipping lines that are not whole records."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for line in data.splitlines():
        try:
            d = orjson.loads(line)
            yield Interval(ts=float(d["ts"]), run=float(d["run"]), dt=float(d["dt"]), answers=int(d["answers"]),
                           tokens=int(d["tokens"]), usd=float(d["usd"]), errors=int(d["errors"]),
                           in_flight=int(d["in_flight"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line or a hand edit: the rest still counts


class Series:
    """Points of a fixed interval, at most `capacity`; full, it merges neighbours in pairs."""

    def __init__(self, interval_s: float, capacity: int) -> None:
        self.interval_s = interval_s
        self.capacity = max(2, capacity)
        self.points: list[tuple[float, ...]] = []
        self._acc: list[Interval] = []   # raw intervals not yet making up one point

    def add(self, iv: Interval) -> bool:
        """Take one raw interval; True when a point was completed."""
        self._acc.append(iv)
        if sum(i.dt for i in self._acc) < self.interval_s * 0.999:
            return False
        acc, self._acc = self._acc, []
        self.points.append(Interval(
            ts=acc[0].ts, run=acc[0].run, dt=sum(i.dt for i in acc), answers=sum(i.answers for i in acc),
            tokens=sum(i.tokens for i in acc), usd=sum(i.usd for i in acc), errors=sum(i.errors for i in acc),
            in_flight=round(sum(i.in_flight for i in acc) / len(acc))).point())
        if len(self.points) > self.capacity:
            self._halve()
        return True

    def _halve(self) -> None:
        merged = []
        for i in range(0, len(self.points) - 1, 2):
            a, b = self.points[i], self.points[i + 1]
            merged.append((a[0],) + tuple(round((x + y) / 2, 6) for x, y in zip(a[1:], b[1:])))
        if len(self.points) % 2:
            merged.append(self.points[-1])
        self.points = merged
        self.interval_s *= 2


class TimelineRecorder:
    def __init__(self, path: Path | None, *, interval_s: float = 5.0, capacity: int = 360,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] | None = None,
                 on_write_error: Callable[[str, str], None] | None = None) -> None:
        self.path = path
        self.base_interval_s = interval_s
        self.series = Series(interval_s, capacity)
        self.runs: list[float] = []
        self.started_at = 0.0
        self._clock = clock
        # A test's own wall clock, given alone, is its monotonic clock too.
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._mono_start = 0.0
        self._on_write_error = on_write_error
        self._last: tuple[float, Totals] | None = None
        self._file: IO[bytes] | None = None
        self._write_failed = False
        self._built: Timeline | None = None

    @property
    def first_started_at(self) -> float:
        return min(self.runs) if self.runs else self.started_at

    def load(self) -> None:
        """Read the history earlier runs of this directory left (blocking: call it in a thread)."""
        if self.path is None:
            return
        for iv in read_history(self.path):
            if not self.runs or self.runs[-1] != iv.run:
                if iv.run not in self.runs:
                    self.runs.append(iv.run)
            self.series.add(iv)
        self._built = None

    def start(self, totals: Totals) -> None:
        """This run begins now, from these totals."""
        now = self._clock()
        self.started_at = now
        self._mono_start = self._monotonic()
        self.runs.append(now)
        self._last = (self._mono_start, totals)
        self._built = None

    def observe(self, totals: Totals) -> bool:
        """Close an interval when one has passed since the last; True when the timeline changed."""
        if self._last is None:
            self.start(totals)
            return False
        now = self._monotonic()
        since, before = self._last
        if now - since < self.base_interval_s:
            return False
        self._last = (now, totals)
        iv = Interval(ts=self.started_at + (since - self._mono_start), run=self.started_at, dt=now - since,
                      answers=max(0, totals.answers - before.answers),
                      tokens=max(0, totals.tokens - before.tokens), usd=max(0.0, totals.usd - before.usd),
                      errors=max(0, totals.errors - before.errors), in_flight=totals.in_flight)
        self._write(iv)
        if self.series.add(iv):
            self._built = None
            return True
        return False

    def _write(self, iv: Interval) -> None:
        if self.path is None or self._write_failed:
            return
        try:
            if self._file is None:
                self._file = open(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE), "ab")
            self._file.write(orjson.dumps({"ts": round(iv.ts, 3), "run": round(iv.run, 3), "dt": round(iv.dt, 3),
                                           "answers": iv.answers, "tokens": iv.tokens, "usd": round(iv.usd, 6),
                                           "errors": iv.errors, "in_flight": iv.in_flight}) + b"\n")
            self._file.flush()
        except OSError as e:
            # The history is a convenience: a full disk stops it (once, said in the log), never the run.
            self._write_failed = True
            if self._on_write_error is not None:
                self._on_write_error(str(self.path), str(e.strerror or e))

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def timeline(self) -> Timeline:
        if self._built is None:
            self._built = Timeline(interval_s=self.series.interval_s, points=tuple(self.series.points),
                                   runs=tuple(self.runs))
        return self._built


def timeline_from_file(path: Path, *, interval_s: float | None = None, capacity: int = 360) -> Timeline:
    """The history a run left, as the history view shows it (for `draftgen report`); by default in
    points of the interval the run recorded at."""
    if interval_s is None:
        interval_s = next((iv.dt for iv in read_history(path)), 5.0)
    recorder = TimelineRecorder(path, interval_s=interval_s, capacity=capacity)
    recorder.load()
    return recorder.timeline()
