"""The run's events on their way out: redacted, repeats of a warning held back, logged, published.

This is the one place an event is redacted: every text field of its payload (a server's error, a
cause, a path) goes through the run's Redactor before the message is made from them, so neither the
views, events.log nor an attach stream ever carry the API key.

The same warning again within REPEAT_WINDOW_S is counted, not logged (an outage that flaps says so
once); the count is said when the window ends, before the run's end event, or when the run closes
(`flush_repeats`): the log never says a warning came after the run ended when it came before.
"""

from __future__ import annotations

import dataclasses
import time
import typing

from draftgen.core.live.events import Event, EventKind, Level, Payload
from draftgen.core.live.hub import Hub
from draftgen.core.rundir import EventLog
from draftgen.core.secrets import Redactor

REPEAT_WINDOW_S = 30.0
# Events that close a part of the run: the warnings held back before them are counted first.
CLOSING = frozenset({EventKind.RUN_DONE, EventKind.RUN_FAILED})


def redacted(payload: Payload, redact: Redactor) -> Payload:
    """`payload` with each of its text fields redacted (the same payload when none changes)."""
    changes: dict[str, typing.Any] = {}
    for f in dataclasses.fields(payload):
        value = getattr(payload, f.name)
        if isinstance(value, str) and not isinstance(value, Level) and (clean := redact(value)) != value:
            changes[f.name] = clean
    return dataclasses.replace(payload, **changes) if changes else payload


class EventPublisher:
    """Events to the hub (the views) and to events.log, once the log is open."""

    def __init__(self, hub: Hub, redact: Redactor) -> None:
        self._hub = hub
        self._redact = redact
        self._log: EventLog | None = None  # events before the run directory is live go to the hub only
        # (kind, message, dataset) -> [first seen, times, the payload]
        self._repeats: dict[tuple[str, str, str], tuple[float, list[int], Payload]] = {}

    def open_log(self, log: EventLog) -> None:
        self._log = log

    def close(self) -> None:
        self.flush_repeats()
        if self._log is not None:
            self._log.close()

    def emit(self, payload: Payload, /) -> None:
        payload = redacted(payload, self._redact)
        message = self._redact(payload.text())  # a text() that adds words of its own: redacted as well
        if payload.kind in CLOSING:
            self.flush_repeats()
        if payload.level == Level.WARN:
            now = time.monotonic()
            key = (payload.kind, message, payload.dataset)
            seen = self._repeats.get(key)
            if seen is not None and now - seen[0] < REPEAT_WINDOW_S:
                seen[1][0] += 1  # held back: counted, said when the window ends or the run closes
                return
            if len(self._repeats) > 256:
                self.flush_repeats()
            self._repeats[key] = (now, [0], payload)
            if seen is not None and seen[1][0]:
                message += f" (and {seen[1][0]} more like it in the {REPEAT_WINDOW_S:.0f} s before)"
        self._publish(payload, message)

    def flush_repeats(self) -> None:
        """Say how many times each held-back warning came, and forget them."""
        held, self._repeats = self._repeats, {}
        for (_, message, _), (_, times, payload) in held.items():
            if times[0]:
                self._publish(payload, f"{message} (and {times[0]} more like it within {REPEAT_WINDOW_S:.0f} s)")

    def _publish(self, payload: Payload, message: str) -> None:
        event = Event(time.time(), payload, message)
        if self._log is not None:
            self._log.write(event.level, message, event.ts)
        self._hub.publish_event(event)
