"""The run's events on their way out: redacted, repeats of a warning held back, logged, published.

The same warning again within REPEAT_WINDOW_S is counted, not logged (an outage that flaps says so
once); the count is said when the window ends, before the run's end event, or when the run closes
(`flush_repeats`): the log never says a warning came after the run ended when it came before.
"""

from __future__ import annotations

import time

from draftgen.core.live.events import Event, EventData, EventKind, Level
from draftgen.core.live.hub import Hub
from draftgen.core.rundir import EventLog
from draftgen.core.secrets import Redactor

REPEAT_WINDOW_S = 30.0
# Events that close a part of the run: the warnings held back before them are counted first.
CLOSING = frozenset({EventKind.RUN_DONE, EventKind.RUN_FAILED})


class EventPublisher:
    """Events to the hub (the views) and to events.log, once the log is open."""

    def __init__(self, hub: Hub, redact: Redactor) -> None:
        self._hub = hub
        self._redact = redact
        self._log: EventLog | None = None  # events before the run directory is live go to the hub only
        self._repeats: dict[tuple[str, str, str], list[float]] = {}  # (kind, message, dataset) -> [first seen, times]

    def open_log(self, log: EventLog) -> None:
        self._log = log

    def close(self) -> None:
        self.flush_repeats()
        if self._log is not None:
            self._log.close()

    def emit(self, level: Level | str, kind: EventKind | str, message: str, dataset: str = "",
             data: EventData | None = None) -> None:
        message = self._redact(message)
        if kind in CLOSING:
            self.flush_repeats()
        if level == Level.WARN:
            now = time.monotonic()
            seen = self._repeats.get((kind, message, dataset))
            if seen is not None and now - seen[0] < REPEAT_WINDOW_S:
                seen[1] += 1  # held back: counted, said when the window ends or the run closes
                return
            if len(self._repeats) > 256:
                self.flush_repeats()
            self._repeats[(kind, message, dataset)] = [now, 0]
            if seen is not None and seen[1]:
                message += f" (and {seen[1]:.0f} more like it in the {REPEAT_WINDOW_S:.0f} s before)"
        self._publish(level, kind, message, dataset, data)

    def flush_repeats(self) -> None:
        """Say how many times each held-back warning came, and forget them."""
        held, self._repeats = self._repeats, {}
        for (kind, message, dataset), (_, times) in held.items():
            if times:
                self._publish(Level.WARN, kind, f"{message} (and {times:.0f} more like it within "
                              f"{REPEAT_WINDOW_S:.0f} s)", dataset)

    def _publish(self, level: Level | str, kind: EventKind | str, message: str, dataset: str = "",
                 data: EventData | None = None) -> None:
        event = Event(time.time(), level, kind, message, dataset, data)  # type: ignore[arg-type]  # coerced to the enums
        if self._log is not None:
            self._log.write(level, message, event.ts)
        self._hub.publish_event(event)
