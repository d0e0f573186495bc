"""The draftgen app: panels fed from the engine's snapshots, keys wired to the control surface.

It reads only `controls.hub` (snapshots and events) and calls only the `Controls` methods, so the
same app shows a run embedded in this process or one attached over the socket (read-only). What
each key does (and which keys an attached viewer gets) is tui/keys.py's.
Rendering is pulled on a one-shot timer re-armed after each pass (never two passes at once, at most
`refresh_s` apart), so an engine publishing faster than the screen only costs dropped snapshots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.driver import Driver
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Static

from draftgen.core.live.control import Controls
from draftgen.core.live.events import Event
from draftgen.core.live.hub import Subscription
from draftgen.core.live.snapshot import RunSnapshot
from draftgen.core.run import registry
from draftgen.tui.keys import RunKeys, stage_action
from draftgen.tui.panels.credits import CreditsPanel
from draftgen.tui.panels.datasets import DatasetsPanel
from draftgen.tui.panels.errors import ErrorsPanel
from draftgen.tui.panels.eventlog import EventLogPanel, EventStore
from draftgen.tui.panels.gpu import GpuPanel
from draftgen.tui.panels.header import AlertBar, RunHeader
from draftgen.tui.panels.history import HistoryPanel
from draftgen.tui.panels.panel import Panel
from draftgen.tui.panels.providers import ProvidersPanel
from draftgen.tui.panels.stages import StagesPanel
from draftgen.tui.panels.throughput import ThroughputPanel
from draftgen.tui.screens.help import CONTROL_KEYS

MIN_SIZE = (80, 24)  # below it a one-line notice replaces the panels


class _HangupSafeFile:
    """Textual's output file, made safe for a terminal that hung up (a closed tmux pane): a failed write
    (EIO) is dropped instead of raised. Textual's writer thread dies on the first error, and the app's
    next writes then block the event loop, and with it the drain, on the writer's full queue."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, text: str) -> int:
        try:
            return int(self._file.write(text))
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._file.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class DraftgenApp(RunKeys, App[None]):
    """The run's screen: its layout, and each pass that renders the newest snapshot."""

    CSS_PATH = "draftgen.tcss"
    ENABLE_COMMAND_PALETTE = False
    # Screen classes the stylesheet keys on: borders only where there are rows to spare.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide"), (160, "-huge")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS = [
        Binding("p", "pause", "pause"),
        Binding("r", "resume", "resume"),
        # Each stage's key (core/run/registry.py): its own action when keys.py has one, else `stage`.
        *(Binding(str(s.key), stage_action(s.name), s.name) for s in registry.keyed()),
        Binding(",".join(CONTROL_KEYS), "read_only", show=False),  # attached: these keys say why they do nothing
        Binding("l", "log", "log"),
        Binding("h", "history", "history"),
        Binding("slash", "search", "search", show=False),
        Binding("pageup", "scroll_log('page_up')", show=False),
        Binding("pagedown", "scroll_log('page_down')", show=False),
        Binding("home", "scroll_log('first')", show=False),
        Binding("end", "scroll_log('last')", show=False),
        Binding("q", "quit_run", "quit"),
        # Never exit without asking: Ctrl-C and Ctrl-Q ask like q.
        Binding("ctrl+q,ctrl+c", "quit_run", "quit", show=False, priority=True),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, controls: Controls, *, title: str = "draftgen", refresh_s: float = 0.25,
                 queue_size: int = 256, run_dir: Path | None = None) -> None:
        super().__init__()
        self.controls = controls
        self.run_dir = run_dir  # where a dataset's drill-down reads its conversations (None: it shows none)
        self.title = title
        self.refresh_s = refresh_s
        self.latest: RunSnapshot | None = None
        self.quit_requested = False
        self._queue_size = queue_size
        self._sub: Subscription | None = None
        self._timer: Timer | None = None
        self._shape: object = None
        self._owed: Screen[Any] | None = None  # a view pushed but not composed when a snapshot came
        self.events = EventStore()

    def get_driver_class(self) -> type[Driver]:
        base = super().get_driver_class()

        class HangupSafeDriver(base):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                file = getattr(self, "_file", None)
                if file is not None:
                    self._file = _HangupSafeFile(file)

        return HangupSafeDriver

    def compose(self) -> ComposeResult:
        yield RunHeader(self.title, id="header")
        yield AlertBar(id="alert")
        yield Static(id="too-small")
        with Vertical(id="body"):
            yield DatasetsPanel(id="datasets")
            with Horizontal(id="middle"):
                yield ThroughputPanel(id="throughput")
                yield CreditsPanel(id="credits")
                with Vertical(id="tallies"):
                    yield ErrorsPanel(id="errors")
                    yield ProvidersPanel(id="providers")
                yield HistoryPanel(id="mini-history")
            with Horizontal(id="lower"):
                yield StagesPanel(id="stages")
                yield GpuPanel(id="gpu")
            yield EventLogPanel(self.events, id="events")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        for hidden in ("#alert", "#lower", "#stages", "#gpu"):  # until a snapshot gives them something to show
            self.query_one(hidden).add_class("-hidden")
        self._sub = self.controls.hub.subscribe(maxsize=self._queue_size)
        self._fit_screen()
        self.pull()
        self._timer = self.set_timer(self.refresh_s, self._tick)

    def on_resize(self) -> None:
        self._fit_screen()

    def _fit_screen(self) -> None:
        """Below 80x24 the panels would clip: one line says so instead (the run goes on)."""
        width, height = self.size
        small = width < MIN_SIZE[0] or height < MIN_SIZE[1]
        base = self.screen_stack[0] if self.screen_stack else None
        if base is None:
            return
        base.set_class(small, "-too-small")
        if small:
            notice = Text(f"{width}×{height} is too small: draftgen needs {MIN_SIZE[0]}×{MIN_SIZE[1]} "
                          "(the run goes on)",
                          no_wrap=True, overflow="ellipsis")
            self.query_one("#too-small", Static).update(notice)

    def on_unmount(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        if self._sub is not None:
            self._sub.close()
            self._sub = None

    # -- rendering --------------------------------------------------------------------------------

    def _tick(self) -> None:
        try:
            self.pull()
        finally:
            self._timer = self.set_timer(self.refresh_s, self._tick)

    def pull(self) -> None:
        """Take everything the hub queued since the last pass; render the newest snapshot only."""
        if self._sub is None or not self.screen_stack:
            return  # not mounted yet, or shutting down
        newest: RunSnapshot | None = None
        events: list[Event] = []
        while (item := self._sub.get_nowait()) is not None:
            if item[0] == "snapshot":
                newest = item[1]
            else:
                events.append(item[1])
        if events:
            self.events.extend(events)
            self._sync_logs()
        # A resize can change what panels show (short screens keep to essentials): redraw then too.
        shape = (self.size, self.screen_stack[0].classes)
        reshaped, self._shape = shape != self._shape, shape
        if reshaped:
            self._fit_screen()
        owed = self._owed is not None and self._owed.is_mounted  # composed since: it gets the newest now
        if owed:
            self._owed = None
        if newest is None and (reshaped or owed):
            newest = self.latest
        if newest is not None and (newest is not self.latest or reshaped or owed):
            self.render_snapshot(newest)

    def _sync_logs(self) -> None:
        for screen in {self.screen_stack[0], self.screen}:
            for log in screen.query(EventLogPanel):
                log.sync()

    def render_snapshot(self, s: RunSnapshot) -> None:
        previous = self.latest
        self.latest = s
        base = self.screen_stack[0]
        for panel in base.query(Panel):
            panel.show(s)
        base.query_one(EventLogPanel).set_datasets(tuple(d.name for d in s.datasets))
        hidden = base.query_one(StagesPanel).has_class("-hidden") and base.query_one(GpuPanel).has_class("-hidden")
        base.query_one("#lower").set_class(hidden, "-hidden")
        view = self.screen
        if view is not base and hasattr(view, "show"):
            if view.is_mounted:
                view.show(s)
            else:  # pushed by a key in this tick, its widgets not composed yet: shown once they are
                self._owed = view
        if previous is None or previous.attached != s.attached or previous.state != s.state:
            self.refresh_bindings()
        if self.quit_requested and s.finished:  # a drain waits for the stage running (merge, extract) too
            self.exit()
