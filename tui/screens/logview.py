"""The log view (`l`): the events log over the whole screen, with its filters and `/` search."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.tui.panels.eventlog import EventLogPanel, EventStore
from draftgen.tui.panels.header import RunHeader


class LogScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "back", "back"),
        Binding("slash", "search", "search"),
        Binding("v", "level", "level", show=False),  # shown by the log itself, which has the focus
        Binding("d", "dataset", "dataset", show=False),
        Binding("c", "clear", "clear filters"),
        Binding("end", "follow", "follow", show=False),
    ]

    def __init__(self, store: EventStore, datasets: tuple[str, ...], *, search: bool = False) -> None:
        super().__init__()
        self.store = store
        self.datasets = datasets
        self._search_first = search

    def compose(self) -> ComposeResult:
        yield RunHeader("draftgen", id="header")
        log = EventLogPanel(self.store, id="log", title="events log")
        log.set_datasets(self.datasets)
        yield log
        yield Input(placeholder="search the messages (enter: apply, esc: cancel)", id="log-search")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        search = self.query_one("#log-search", Input)
        search.add_class("-hidden")
        log = self.query_one(EventLogPanel)
        log.sync(force=True)
        log.focus()
        latest = getattr(self.app, "latest", None)
        if latest is not None:
            self.query_one(RunHeader).show(latest)
        if self._search_first:
            self.action_search()

    def show(self, s: RunSnapshot) -> None:
        self.query_one(RunHeader).show(s)
        log = self.query_one(EventLogPanel)
        log.set_datasets(tuple(d.name for d in s.datasets))
        log.sync()

    @property
    def events_log(self) -> EventLogPanel:
        return self.query_one(EventLogPanel)

    def action_search(self) -> None:
        search = self.query_one("#log-search", Input)
        search.value = self.events_log.search
        search.remove_class("-hidden")
        search.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.add_class("-hidden")
        self.events_log.set_filter(search=event.value.strip())
        self.events_log.focus()

    def action_back(self) -> None:
        search = self.query_one("#log-search", Input)
        if search.has_focus:
            search.add_class("-hidden")
            self.events_log.focus()
            return
        self.dismiss(None)

    def action_level(self) -> None:
        self.events_log.action_cycle_level()

    def action_dataset(self) -> None:
        self.events_log.action_cycle_dataset()

    def action_clear(self) -> None:
        self.events_log.set_filter(level=0, dataset="", search="")

    def action_follow(self) -> None:
        self.events_log.action_last()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While typing a search, letters are text, not keys.
        if action in ("level", "dataset", "clear", "search") and self.query_one("#log-search", Input).has_focus:
            return False
        return True
