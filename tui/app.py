"""The draftgen app: panels fed from the engine's snapshots, keys wired to the control surface.

It reads only `controls.hub` (snapshots and events) and calls only the `Controls` methods, so the
same app shows a run embedded in this process or one attached over the socket (read-only).
Rendering is pulled on a one-shot timer re-armed after each pass (never two passes at once, at most
`refresh_s` apart), so an engine publishing faster than the screen only costs dropped snapshots.
"""

from __future__ import annotations

from typing import Any

from draftgen.core.live import snapshot as snap
from draftgen.core.live.control import Controls
from draftgen.core.live.hub import Subscription
from draftgen.core.live.snapshot import Event, RunSnapshot
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.driver import Driver
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from rich.text import Text
from textual.widgets import Footer, Static

from draftgen.tui.panels.credits import CreditsPanel
from draftgen.tui.panels.datasets import DatasetsPanel
from draftgen.tui.panels.errors import ErrorsPanel
from draftgen.tui.panels.eventlog import EventLogPanel, EventStore
from draftgen.tui.panels.gpu import GpuPanel
from draftgen.tui.panels.header import AlertBar, RunHeader
from draftgen.tui.panels.history import HistoryPanel
from draftgen.tui.screens.drill import DrillScreen, Target
from draftgen.tui.screens.help import HelpScreen
from draftgen.tui.screens.history import HistoryScreen
from draftgen.tui.screens.logview import LogScreen
from draftgen.tui.panels.panel import Panel, SelectablePanel
from draftgen.tui.panels.providers import ProvidersPanel
from draftgen.tui.screens.quitdialog import SPOOL, STOP, QuitScreen
from draftgen.tui.screens.smoke import SmokeScreen
from draftgen.tui.panels.stages import StagesPanel, active_stages
from draftgen.tui.panels.throughput import ThroughputPanel

# Actions that change the run: hidden from the footer when attached read-only, where their keys
# answer that the viewer is read-only.
CONTROL_ACTIONS = frozenset({"pause", "resume", "smoke", "merge", "extract"})
VIEW_ACTIONS = frozenset({"log", "search", "history"})
APP_ACTIONS = CONTROL_ACTIONS | VIEW_ACTIONS | {"quit_run", "help", "read_only"}
FINAL_STATES = (snap.RunState.DONE, snap.RunState.STOPPED, snap.RunState.DRAINED, snap.RunState.WAITING,
                snap.RunState.LIMITED)
VIEW_SCREENS = (LogScreen, HistoryScreen, DrillScreen)
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


class DraftgenApp(App[None]):
    CSS_PATH = "draftgen.tcss"
    ENABLE_COMMAND_PALETTE = False
    # Screen classes the stylesheet keys on: borders only where there are rows to spare.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide"), (160, "-huge")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    BINDINGS = [
        Binding("p", "pause", "pause"),
        Binding("r", "resume", "resume"),
        Binding("s", "smoke", "smoke"),
        Binding("m", "merge", "merge"),
        Binding("x", "extract", "extract"),
        Binding("p,r,s,m,x", "read_only", show=False),  # attached: these keys say why they do nothing
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
                 queue_size: int = 256) -> None:
        super().__init__()
        self.controls = controls
        self.title = title
        self.refresh_s = refresh_s
        self.latest: RunSnapshot | None = None
        self.quit_requested = False
        self._queue_size = queue_size
        self._sub: Subscription | None = None
        self._timer: Timer | None = None
        self._shape: object = None
        self.events = EventStore()

    def get_driver_class(self) -> type[Driver]:
        base = super().get_driver_class()

        class HangupSafeDriver(base):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if getattr(self, "_file", None) is not None:
                    self._file = _HangupSafeFile(self._file)

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
            notice = Text(f"{width}×{height} is too small: draftgen needs {MIN_SIZE[0]}×{MIN_SIZE[1]} (the run goes on)",
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
        if newest is None and reshaped:
            newest = self.latest
        if newest is not None and (newest is not self.latest or reshaped):
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
        if self.screen is not base and hasattr(self.screen, "show"):
            self.screen.show(s)
        if previous is None or previous.attached != s.attached or previous.state != s.state:
            self.refresh_bindings()
        if self.quit_requested and s.finished():  # a drain waits for the stage running (merge, extract) too
            self.exit()

    # -- keys -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action not in APP_ACTIONS:
            return True
        if len(self.screen_stack) > 1:
            # A view (log, history, drill-down) still quits like the main screen; a dialog has its own keys.
            return action == "quit_run" and isinstance(self.screen, VIEW_SCREENS)
        if action == "read_only":
            return self.controls.read_only
        if self.controls.read_only and action in CONTROL_ACTIONS:
            return False  # hidden from the footer; the key answers through action_read_only
        return True

    def action_read_only(self) -> None:
        self.clear_notifications()  # one toast that is replaced, not a stack that covers the screen
        self.notify("read-only: attached viewer (control keys work in the terminal that runs it)",
                    title="attached", severity="warning")

    # -- views ------------------------------------------------------------------------------------

    def on_selectable_panel_open(self, message: SelectablePanel.Open) -> None:
        if self.latest is not None:
            self.push_screen(DrillScreen(Target(message.what, message.name), self.latest))

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.events, self._dataset_names()))

    def action_search(self) -> None:
        self.push_screen(LogScreen(self.events, self._dataset_names(), search=True))

    def action_history(self) -> None:
        self.push_screen(HistoryScreen(self.latest))

    def action_scroll_log(self, how: str) -> None:
        log = self.screen_stack[0].query_one(EventLogPanel)
        getattr(log, f"action_{how}")()

    def _dataset_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.latest.datasets) if self.latest else ()

    def _allowed(self, action: str) -> bool:
        """Ask the controls first; a stage that cannot start yet says why instead."""
        reason = self.controls.unavailable(action)
        if reason:
            self.clear_notifications()
            # The reason quotes config keys ("[extract] model"): text, not Textual markup.
            self.notify(reason, title=f"{action}: not available", severity="warning", markup=False)
            return False
        return True

    def action_pause(self) -> None:
        if self._allowed("pause"):
            self.controls.pause()

    def action_resume(self) -> None:
        if self._allowed("resume"):
            self.controls.resume()

    def action_smoke(self) -> None:
        if self._allowed("smoke"):
            self.controls.run_smoke()
            self.push_screen(SmokeScreen(self.latest))

    def action_merge(self) -> None:
        if self._allowed("merge"):
            self.controls.start_merge()
            self.notify("merge started: progress in the stages panel", title="merge")

    def action_extract(self) -> None:
        if self._allowed("extract"):
            self.controls.start_extract()
            self.notify("extraction started: progress in the stages and GPU panels", title="extract")

    def action_quit_run(self) -> None:
        if self.controls.read_only:
            self.exit()  # a viewer closes itself only; the run goes on
            return
        while len(self.screen_stack) > 1 and isinstance(self.screen, VIEW_SCREENS):
            self.pop_screen()
        if len(self.screen_stack) > 1:
            return
        if not self._allowed("quit"):
            return
        s = self.latest
        busy = s is None or s.state not in (*FINAL_STATES, snap.RunState.IDLE) or any(
            st.state == "running" for st in active_stages(s))
        if not busy:
            self.controls.quit(drain=True)  # nothing in flight: nothing to choose between
            self.exit()
            return
        self.controls.quit_asked(True)  # a run not started yet (the smoke test runs) waits for the answer
        self.push_screen(QuitScreen(s.throughput.in_flight if s else 0, s.held_answers if s else 0, snapshot=s),
                         self._quit_chosen)

    def _quit_chosen(self, choice: str | None) -> None:
        if choice is None:
            self.controls.quit_asked(False)
            return
        self.quit_requested = True
        drain = choice != STOP  # wait and spool both let the requests in flight finish
        self.controls.quit(drain=drain)
        self.controls.quit_asked(False)
        if choice == SPOOL:
            self.controls.spool_held()
        # Stop now means now: the engine winds down after the screen is gone. A drain keeps the
        # screen up until the engine reports the run stopped (q again offers stop now).
        if not drain or (self.latest is not None and self.latest.finished()):
            self.exit()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.controls.read_only))
