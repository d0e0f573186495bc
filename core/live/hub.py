"""Fan-out of snapshots and events from the engine to any number of views.

Each subscriber has a bounded queue: a slow view (or an attach client that never reads) loses old
snapshots, never slows the engine. The latest snapshot is always kept for newcomers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Literal

from draftgen.core.live.events import Event
from draftgen.core.live.snapshot import RunSnapshot

Item = tuple[Literal["snapshot"], RunSnapshot] | tuple[Literal["event"], Event]


class Subscription:
    def __init__(self, hub: Hub, maxsize: int) -> None:
        self._hub = hub
        self._items: deque[Item] = deque()
        self._maxsize = maxsize
        self._ready = asyncio.Event()
        self.dropped = 0

    def _put(self, item: Item) -> None:
        if len(self._items) >= self._maxsize:
            # Drop the oldest snapshot first; events are rarer and matter more.
            for i, old in enumerate(self._items):
                if old[0] == "snapshot":
                    del self._items[i]
                    break
            else:
                self._items.popleft()
            self.dropped += 1
        self._items.append(item)
        self._ready.set()

    def get_nowait(self) -> Item | None:
        if not self._items:
            self._ready.clear()
            return None
        return self._items.popleft()

    async def get(self) -> Item:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def close(self) -> None:
        self._hub._subs.discard(self)


class Hub:
    def __init__(self, recent_events: int = 200) -> None:
        self._subs: set[Subscription] = set()
        self.latest: RunSnapshot | None = None
        self.recent: deque[Event] = deque(maxlen=recent_events)

    def subscribe(self, maxsize: int = 64) -> Subscription:
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        for event in self.recent:
            sub._put(("event", event))
        if self.latest is not None:
            sub._put(("snapshot", self.latest))
        return sub

    def publish_snapshot(self, snap: RunSnapshot) -> None:
        self.latest = snap
        for sub in tuple(self._subs):
            sub._put(("snapshot", snap))

    def publish_event(self, event: Event) -> None:
        self.recent.append(event)
        for sub in tuple(self._subs):
            sub._put(("event", event))
