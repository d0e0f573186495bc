"""The viewer's side of attach (`draftgen attach RUN_DIR`): the stream core/live/attach.py serves, read
back into snapshots and events (`AttachClient`, reconnecting whenever the run restarts), and the
read-only `Controls` a viewer's app renders from them (`AttachControls`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from draftgen.core.live.attach import DENIED, MAX_LINE, AttachError, run_directory, short_path
from draftgen.core.live.control import Action
from draftgen.core.live.events import Event, Level
from draftgen.core.live.hub import Hub
from draftgen.core.live.snapshot import RunSnapshot, RunState, event_from_dict, snapshot_from_dict
from draftgen.core.live.stage_payloads import Attach
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible

WAITING, LIVE, ENDED = "waiting for run", "live", "run ended"
# The states a run ends in, as its last line in events.log names them ("... INFO  run DONE: 429 of 492 answered, ...;").
_END_STATES = frozenset({RunState.DONE, RunState.STOPPED, RunState.DRAINED, RunState.WAITING, RunState.LIMITED})


def last_run_ended(run_dir: Path, tail_bytes: int = 1 << 16) -> str:
    """When and how the last run to end in `run_dir` ended, from the end of its events.log ("2026-12-02
    15:10:07 (DONE: 429 of 492 answered, ...)"); "" when no run has ended there (or there is no log). The
    line is the file's (an older version may have written a server's text raw): its controls escaped."""
    try:
        with open(RunDir(run_dir).events_log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    for line in reversed(text.splitlines()):
        stamp, rest = line[:19], line[20:].split(None, 1)  # "YYYY-MM-DD HH:MM:SS LEVEL  message"
        message = rest[1] if len(rest) == 2 else ""
        ended = message[4:].split(";")[0]  # "DONE: 429 of 492 answered, ...", "LIMITED by max_usd: ..."
        if message.startswith("run ") and ended.split(" ", 1)[0].rstrip(":") in _END_STATES:
            return visible(f"{stamp} ({ended})")
    return ""


@dataclass(frozen=True)
class AttachState:
    """Where the viewer stands: waiting for a run to serve, live, or the run said it ended."""
    state: str
    message: str


AttachItem = RunSnapshot | Event | AttachState


class AttachClient:
    """Snapshots, events and connection states from the run in `run_dir`, reconnecting whenever the
    run restarts: while nothing serves the socket the state is "waiting for run" (or stays "run
    ended" after a goodbye) and a connection is tried every `retry_s`."""

    def __init__(self, run_dir: Path, *, retry_s: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.path = RunDir(self.run_dir).socket
        self.retry_s = retry_s
        self.state = ""  # none yet: the first state is always reported

    def __aiter__(self) -> AsyncIterator[AttachItem]:
        return self._items()

    def _enter(self, state: str, message: str) -> AttachState:
        self.state = state
        return AttachState(state, message)

    async def _items(self) -> AsyncIterator[AttachItem]:
        while True:
            try:
                with short_path(self.path) as name:
                    reader, writer = await asyncio.open_unix_connection(name, limit=MAX_LINE)
            except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
                if self.state not in (WAITING, ENDED):
                    # Attached after the run ended: say so, or the wait reads as a run about to start.
                    ended = await asyncio.to_thread(last_run_ended, self.run_dir) if not self.state else ""
                    yield self._enter(WAITING, f"waiting for run: nothing serves {self.path} yet; "
                                      + (f"the last run here ended {ended}; " if ended else "")
                                      + f"retrying every {self.retry_s:g} s")
                await asyncio.sleep(self.retry_s)
                continue
            except PermissionError as e:
                raise AttachError(f"cannot attach to {self.path}: {DENIED}") from e
            try:
                while line := await reader.readline():
                    item = self._parse(line)
                    if isinstance(item, AttachState):
                        yield self._enter(item.state, item.message)
                    elif item is not None and self.state == LIVE:
                        yield item
            except (ConnectionError, asyncio.LimitOverrunError, ValueError):
                pass
            finally:
                writer.close()
            if self.state == LIVE:  # gone without a goodbye: crashed or killed
                yield self._enter(WAITING, f"connection to the run lost; waiting for run at {self.path}")
            await asyncio.sleep(self.retry_s)

    def _parse(self, line: bytes) -> AttachItem | None:
        try:
            msg = orjson.loads(line)
            kind = msg["type"]
            if kind == "snapshot":
                return snapshot_from_dict(msg["data"])
            if kind == "event":
                return event_from_dict(msg["data"])
            if kind == "hello":
                return AttachState(LIVE, f"attached to the run in {visible(str(self.run_dir))} (pid {msg.get('pid')})")
            if kind == "bye":
                return AttachState(ENDED, f"{msg.get('reason') or 'run ended'}: showing its last state;"
                                          " a restarted run is picked up")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            pass  # a line from a newer or broken engine: skip it, keep the stream
        return None


class AttachControls:
    """The `Controls` protocol for a viewer: a local hub fed from the socket, every action refused.

    The app renders it like an embedded run; snapshots are marked `attached`, and while the run is
    not live the last snapshot is shown with an alert saying so (waiting for run / run ended).
    """

    read_only = True

    def __init__(self, run_dir: Path, *, retry_s: float = 1.0) -> None:
        run_dir = Path(run_dir)
        run_directory(run_dir)
        self.run_dir = run_dir
        self.error: AttachError | None = None  # why the viewer cannot attach (permission denied), once met
        self.hub = Hub()
        self.client = AttachClient(run_dir, retry_s=retry_s)
        self.status = AttachState(WAITING, "connecting…")
        self._last: RunSnapshot | None = None
        self._seen: deque[tuple[float, str, str]] = deque(maxlen=2000)
        self._task: asyncio.Task[None] | None = None

    def unavailable(self, action: Action | str) -> str | None:
        return "attached read-only: this viewer cannot change the run"

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def start_stage(self, name: str) -> None: ...
    def run_smoke(self) -> None: ...
    def start_merge(self, replace_hidden_states: bool = False) -> None: ...
    def start_extract(self, on_other_merge: str = "refuse") -> None: ...
    def merge_question(self) -> str | None: return None
    def extract_question(self) -> str | None: return None
    def quit(self, drain: bool) -> None: ...
    def quit_asked(self, asking: bool) -> None: ...
    def spool_held(self) -> None: ...

    async def start(self) -> None:
        """Start feeding the hub from the socket, on the running loop (the app's)."""
        if self._task is None:
            self._publish()
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> AttachControls:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self) -> None:
        """Feed the hub from the socket; a refusal (permission denied) is kept in `error` and shown as the
        viewer's state, never a "connecting…" that waits for ever."""
        try:
            await self._follow()
        except AttachError as e:
            self.error = e
            self.status = AttachState(ENDED, str(e))
            self.hub.publish_event(Event.of(Attach(detail=str(e), at=Level.ERROR)))
            self._publish()

    async def _follow(self) -> None:
        note: Event | None = None
        async for item in self.client:
            if isinstance(item, RunSnapshot):
                self._last = item
                self._publish()
                if note is not None:
                    # Logged after the events the engine replays on connect, so the log stays in order.
                    self.hub.publish_event(dataclasses.replace(note, ts=time.time()))
                    note = None
            elif isinstance(item, Event):
                key = (item.ts, item.kind, item.message)
                if key in self._seen:
                    continue  # a reconnect replays the engine's recent events
                self._seen.append(key)
                self.hub.publish_event(item)
            else:
                self.status = item
                event = Event.of(Attach(detail=item.message, at=Level.INFO if item.state == LIVE else Level.WARN))
                if item.state == LIVE:
                    note = event
                else:
                    self.hub.publish_event(event)
                self._publish()

    def _publish(self) -> None:
        """The last snapshot as this viewer should show it: attached, and stale runs flagged."""
        base = self._last or RunSnapshot(run_name=visible(self.run_dir.name), model="—", label=RunState.IDLE)
        alert = base.alert
        if self.status.state != LIVE:
            alert = self.status.message + (f" | {alert}" if alert else "")
        self.hub.publish_snapshot(dataclasses.replace(base, attached=True, alert=alert))

