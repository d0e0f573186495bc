"""The quit dialog: drain (finish the requests in flight) or stop now, or go back."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static

from draftgen.tui import fmt

DRAIN, STOP = "drain", "stop"


class QuitScreen(ModalScreen[str | None]):
    """Dismisses with "drain", "stop" or None (cancel)."""

    BINDINGS = [
        Binding("d", "choose('drain')", "drain"),
        Binding("s", "choose('stop')", "stop now"),
        Binding("escape,c", "choose('')", "cancel"),
    ]

    def __init__(self, in_flight: int) -> None:
        super().__init__(classes="dialog-screen")
        self.in_flight = in_flight

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-dialog", classes="dialog") as box:
            box.border_title = "quit"
            yield Static(Text.assemble(
                ("Quit this run? ", "bold"), f"{fmt.count(self.in_flight)} requests are in flight.\n\n",
                ("d  drain", "bold"), "     stop admitting, let the requests in flight finish, then exit\n",
                ("s  stop now", "bold"), "  exit now; the requests in flight are asked again by the next run\n",
                ("esc  cancel", "bold"), "  keep running\n\n",
                ("Either way every answer already on disk is kept and `draftgen run` resumes.", "dim")))
            with Horizontal(id="quit-buttons"):
                yield Button("Drain (d)", id="drain", variant="primary")
                yield Button("Stop now (s)", id="stop", variant="error")
                yield Button("Cancel (esc)", id="cancel")
        yield Footer(compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_choose(event.button.id if event.button.id in (DRAIN, STOP) else "")

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice or None)
