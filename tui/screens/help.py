"""The help modal: what each key does and how to read the panels."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from draftgen.core.run import registry

# The keys that change the run: pause, resume and each stage's (an attached viewer's answer "read-only").
CONTROL_KEYS = ("p", "r", *(str(s.key) for s in registry.keyed()))

KEYS = (
    ("p", "pause: stop admitting new requests; those in flight finish and are recorded"),
    ("r", "resume: admit requests again (also after adding credits following a 402)"),
    *((str(s.key), s.help) for s in registry.keyed()),  # the stages' keys (core/run/registry.py)
    ("q", "quit: choose drain (finish requests in flight) or stop now; nothing on disk is lost (Ctrl-C,"
          " Ctrl-Q ask the same)"),
    ("tab", "move between the datasets, errors, providers and events panels"),
    ("↑ ↓  j k", "move the cursor in the focused panel"),
    ("enter", "drill down: a dataset, error kind or provider with its recent errors (prompt ids, providers,"
              " attempts, messages); esc goes back"),
    ("[  ]", "in a turns = \"all\" dataset's drill-down: an older, a newer conversation, step by step"
             " (tool calls and results too)"),
    ("l  /", "the events log on the whole screen; / searches it"),
    ("v  d  c", "in the log: cycle the level (all, warn+, error), cycle the dataset, clear the filters"),
    ("PgUp PgDn Home End", "scroll the events log; it follows new events again at End"),
    ("h", "history: requests/s, tokens/s, spend per minute, error rate and in flight over the whole run"),
    ("?", "this help"),
)

READING = (
    ("throughput", "'last 30 s' columns cover the recent window only; 'since start' columns average the"
                   " whole run. Early short answers drag the since-start average down."),
    ("in flight", "requests sent and not yet answered; 'limit 460 of 500' means sustained 429s backed the"
                  " concurrency off to 460 of the 500 configured (it recovers on its own)"),
    ("datasets", "tokens/budget counts completion tokens (reasoning included); skipped prompts were not"
                 " sent because a budget ran out and stay eligible for a later run; 'proj. total' is the"
                 " dataset's projected cost when finished"),
    ("credits", "the balance is fetched about once a minute, shown with its age, and between fetches"
                " is that balance minus the spend since"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "close")]

    def __init__(self, read_only: bool) -> None:
        super().__init__(classes="dialog-screen")
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2, 0, 0))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for key, what in KEYS:
            keys.add_row(key, what)
        reading = Table.grid(padding=(0, 2, 0, 0))
        reading.add_column(style="bold", no_wrap=True)
        reading.add_column()
        for name, what in READING:
            reading.add_row(name, what)
        parts: list[RenderableType] = [Text("keys", style="bold underline"), keys, Text(""),
                 Text("reading the panels", style="bold underline"), reading]
        if self.read_only:
            parts[:0] = [Text(f"Attached read-only: this viewer cannot change the run; {' '.join(CONTROL_KEYS)} answer"
                              " \"read-only\" and q closes the viewer only.\n", style="bold")]
        with VerticalScroll(id="help-dialog", classes="dialog") as box:
            box.border_title = "help"
            yield Static(Group(*parts))
            yield Static(Text("esc close", style="dim"), classes="dialog-hint")
        yield Footer(compact=True)

    def action_close(self) -> None:
        self.dismiss(None)
