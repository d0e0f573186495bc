"""The events log: every event of the run (the newest `keep`), scrollable, filterable and searchable.

It follows the tail until you move the cursor up; `end` follows again. `v` cycles the level shown
(all, warnings and errors, errors), `d` the dataset (the one the event names in its `dataset`
field; run-wide events belong to none), and the log view's `/` searches (case-insensitive, in the
message). One rule for an event that does not fit: its row is cut at a word with "…", and the
highlighted row is shown whole, wrapped at words under its message (a hanging indent past the time
and level). The full history is in the run's events.log as well.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from rich.cells import get_character_cell_size
from rich.text import Text
from textual.binding import Binding
from textual.widgets import OptionList

from draftgen.core.live.events import Event, Level
from draftgen.tui import fmt

LEVEL_STYLES = {Level.INFO: "", Level.WARN: "bold yellow", Level.ERROR: "bold red"}
LEVELS = (("all", (Level.INFO, Level.WARN, Level.ERROR)), ("warn+", (Level.WARN, Level.ERROR)),
          ("error", (Level.ERROR,)))


def _fits(text: str, start: int, cells: int) -> int:
    """The end of the longest run of `text` from `start` that takes at most `cells` columns."""
    end, used = start, 0
    while end < len(text) and used + get_character_cell_size(text[end]) <= cells:
        used += get_character_cell_size(text[end])
        end += 1
    return end


def cut_at_word(message: Text, cells: int) -> Text:
    """`message` in `cells` columns: whole if it fits, else cut at the last word before the edge with "…"
    (a word longer than half the width is cut where the edge falls)."""
    plain = message.plain
    if _fits(plain, 0, cells) == len(plain):
        return message
    end = _fits(plain, 0, max(1, cells - 1))
    space = plain.rfind(" ", 0, end + 1)
    if space > cells // 2:
        end = space
    while end > 0 and plain[end - 1] in " ,;:(":
        end -= 1
    cut = message[:end]
    cut.append("…", style="dim")
    return cut


def wrap_at_words(message: Text, cells: int, indent: int) -> Text:
    """`message` wrapped at words to `cells` columns, each line after the first indented by `indent`."""
    plain = message.plain
    breaks: list[int] = []
    start = 0
    while True:
        while start < len(plain) and plain[start] == " ":
            start += 1
        end = _fits(plain, start, cells)
        if end >= len(plain):
            break
        space = plain.rfind(" ", start, end + 1)
        end = space if space > start else max(end, start + 1)  # a word longer than a line: cut where it must
        breaks.append(end)
        start = end
    if not breaks:
        return message
    out = Text()
    for k, line in enumerate(message.divide(breaks)):
        line.rstrip()
        if k:
            line = line[len(line.plain) - len(line.plain.lstrip(" ")):]
            out.append("\n" + " " * indent)
        out.append_text(line)
    return out


class EventStore:
    """The events the app has seen, shared by every log widget (the main screen's and the log view's)."""

    def __init__(self, keep: int = 5000) -> None:
        self.events: deque[Event] = deque(maxlen=keep)
        self.version = 0

    def extend(self, events: Iterable[Event]) -> None:
        self.events.extend(events)
        self.version += 1


class EventLogPanel(OptionList):
    """One row per event; the highlighted row whole."""

    DEFAULT_CSS = "EventLogPanel { height: 1fr; scrollbar-size-vertical: 1; }"
    BINDINGS = [
        Binding("v", "cycle_level", "level"),
        Binding("d", "cycle_dataset", "dataset"),
        Binding("k", "cursor_up", show=False),
        Binding("j", "cursor_down", show=False),
        Binding("G", "last", show=False),
    ]

    def __init__(self, store: EventStore | None = None, *, id: str | None = None, title: str = "events") -> None:
        super().__init__(id=id, classes="panel")
        self.store = store or EventStore()
        self.log_title = title
        self.datasets: tuple[str, ...] = ()
        self.level = 0           # index into LEVELS
        self.dataset = ""        # "" = every dataset
        self.search = ""
        self.following = True
        self._shown: list[Event] = []
        self._seen_version = -1
        self._expanded: int | None = None
        self._width = 0
        self._update_title()

    # -- what is shown ----------------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        """The shown events as plain one-line texts (what a test or a copy would want)."""
        return [f"{fmt.wall_time(e.ts)} {e.level:<5} {e.message}" for e in self._shown]

    def wanted(self, e: Event) -> bool:
        if e.level not in LEVELS[self.level][1]:
            return False
        if self.dataset and e.dataset != self.dataset:
            return False
        return not self.search or self.search.lower() in e.message.lower()

    def _prompt(self, e: Event, whole: bool = False) -> Text:
        text = Text.assemble((fmt.wall_time(e.ts), "dim"), " ", (f"{e.level:<5}", LEVEL_STYLES.get(e.level, "")),
                             " ")
        message = Text(" ".join(e.message.split("\n")), style="red" if e.level == Level.ERROR else "")
        if self.search:
            message.highlight_words([self.search], style="reverse", case_sensitive=False)
        width = self.scrollable_content_region.width
        if width:
            room = max(12, width - text.cell_len)
            message = wrap_at_words(message, room, text.cell_len) if whole else cut_at_word(message, room)
        text.append_text(message)
        return text

    def on_resize(self) -> None:
        if self.scrollable_content_region.width != self._width:
            self._width = self.scrollable_content_region.width
            self.sync(force=True)

    def sync(self, force: bool = False) -> None:
        """Show what the store gained since the last call (or everything again, after a filter change)."""
        if not force and self._seen_version == self.store.version:
            return
        if force or self._seen_version < 0:
            self._shown = [e for e in self.store.events if self.wanted(e)]
            self._expanded = None
            self.set_options(self._prompt(e) for e in self._shown)
        else:
            known = self._shown[-1] if self._shown else None
            fresh: list[Event] = []
            for e in reversed(self.store.events):
                if e is known:
                    break
                fresh.append(e)
            fresh = [e for e in reversed(fresh) if self.wanted(e)]
            overflow = len(self._shown) + len(fresh) - (self.store.events.maxlen or 1 << 30)
            if overflow > 0 or (known is not None and known not in self.store.events):
                self.sync(force=True)
                return
            self._shown.extend(fresh)
            self.add_options(self._prompt(e) for e in fresh)
        self._seen_version = self.store.version
        if self.following and self._shown:
            self.highlighted = len(self._shown) - 1
        self._update_title()

    def set_datasets(self, names: tuple[str, ...]) -> None:
        self.datasets = names

    # -- cursor and expansion ---------------------------------------------------------------------

    def watch_highlighted(self, highlighted: int | None) -> None:
        super().watch_highlighted(highlighted)
        if self._expanded is not None and self._expanded != highlighted and self._expanded < len(self._shown):
            self.replace_option_prompt_at_index(self._expanded, self._prompt(self._shown[self._expanded]))
            self._expanded = None
        if highlighted is not None and highlighted < len(self._shown) and self._expanded != highlighted:
            self._expanded = highlighted
            self.replace_option_prompt_at_index(highlighted, self._prompt(self._shown[highlighted], whole=True))
            # Shown whole it may take more rows than when the list scrolled to it: bring all of it in view.
            self.call_after_refresh(self.scroll_to_highlight)
        following = highlighted is None or highlighted >= len(self._shown) - 1
        if following != self.following:
            self.following = following
            self._update_title()

    def _update_title(self) -> None:
        parts = [self.log_title]
        level = LEVELS[self.level][0]
        if level != "all":
            parts.append(f"level {level}")
        if self.dataset:
            parts.append(f"dataset {self.dataset}")
        if self.search:
            parts.append(f"/{self.search}")
        shown = len(self._shown)
        if len(parts) > 1:
            parts.append(f"{shown} of {len(self.store.events)}")
        if not self.following and shown:
            parts.append("scrolled: end follows")
        self.border_title = Text(" · ".join(parts))  # a search typed, a dataset's name: text, not markup

    # -- filters ----------------------------------------------------------------------------------

    def set_filter(self, *, level: int | None = None, dataset: str | None = None, search: str | None = None) -> None:
        if level is not None:
            self.level = level % len(LEVELS)
        if dataset is not None:
            self.dataset = dataset
        if search is not None:
            self.search = search
        self.following = True
        self.sync(force=True)
        self._update_title()

    def action_cycle_level(self) -> None:
        self.set_filter(level=self.level + 1)

    def action_cycle_dataset(self) -> None:
        names = ("",) + self.datasets
        i = names.index(self.dataset) if self.dataset in names else 0
        self.set_filter(dataset=names[(i + 1) % len(names)])

    def action_last(self) -> None:
        self.following = True
        super().action_last()
