"""The quit dialog: drain (finish the requests in flight) or stop now, or go back. While answers the
disk refused are held in memory it offers instead: wait for the disk, or spool them now, or go back;
neither drops them."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static

from draftgen.core.live.snapshot import RunSnapshot
from draftgen.core.live.summary import quit_effects
from draftgen.tui import fmt

DRAIN, STOP, WAIT, SPOOL = "drain", "stop", "wait", "spool"


class QuitScreen(ModalScreen[str | None]):
    """Dismisses with "drain", "stop" or None (cancel); with answers held: "wait", "spool" or None."""

    def __init__(self, in_flight: int, held_answers: int = 0, snapshot: RunSnapshot | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.in_flight = in_flight
        self.held_answers = held_answers
        self.snapshot = snapshot  # the stage running (smoke, generation, merge, extract) says what d and s do
        self.holding = held_answers > 0  # the choices are fixed when it opens; the counts follow the run

    BINDINGS = [
        Binding("d", "choose('drain')", "drain"),
        Binding("s", "choose('stop')", "stop now"),
        Binding("w", "choose('wait')", "wait for the disk"),
        Binding("escape,c", "choose('')", "cancel"),
    ]
    # With answers held, drain waits for the disk and stop now spools them: nothing is dropped.
    HELD = {DRAIN: WAIT, STOP: SPOOL, WAIT: WAIT, SPOOL: SPOOL}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "choose" and parameters == (WAIT,):
            return self.holding
        return True

    def _text(self) -> Text:
        if not self.holding:
            effects = quit_effects(self.snapshot)
            running = effects.running
            return Text.assemble(
                ("Quit this run? ", "bold"), f"{running[:1].upper()}{running[1:]}.\n\n",
                ("d  drain", "bold"), f"     {effects.drain}\n",
                ("s  stop now", "bold"), f"  {effects.stop}\n",
                ("esc  cancel", "bold"), "  keep running\n\n",
                ("Either way every answer already on disk is kept and `draftgen run` resumes.", "dim"))
        return Text.assemble(
            ("Quit this run? ", "bold"),
            (f"{fmt.count(self.held_answers)} paid answers are held in memory, not on disk", "bold red"),
            f" (the disk refused them); {fmt.count(self.in_flight)} requests are in flight.\n\n",
            ("w  wait", "bold"), "      stop admitting; write the held answers once the disk takes them (free space: "
            "the write is retried every few seconds), then exit\n",
            ("s  spool now", "bold"), " stop admitting; write the held answers to a spool file elsewhere "
            "($DRAFTGEN_SPOOL_DIR, the temp dir or ~), which the next `draftgen run` imports, then exit\n",
            ("esc  back", "bold"), "   keep the run (paused until the disk takes them)\n\n",
            ("Either way nothing is dropped: every answer on disk is kept, the held ones are written or spooled "
             "(the summary says which, and where).", "dim"))

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-dialog", classes="dialog") as box:
            box.border_title = "quit"
            yield Static(self._text(), id="quit-text")
            with Horizontal(id="quit-buttons"):
                if self.holding:
                    yield Button("Wait for the disk (w)", id=WAIT, variant="primary")
                    yield Button("Spool now (s)", id=SPOOL, variant="warning")
                    yield Button("Back (esc)", id="cancel")
                else:
                    yield Button("Drain (d)", id=DRAIN, variant="primary")
                    yield Button("Stop now (s)", id=STOP, variant="error")
                    yield Button("Cancel (esc)", id="cancel")
        yield Footer(compact=True)

    def show(self, s: RunSnapshot) -> None:
        """The app passes each new snapshot: the counts stay true while the dialog is open."""
        before = quit_effects(self.snapshot)
        self.snapshot = s
        if (s.throughput.in_flight, s.held_answers) != (self.in_flight, self.held_answers) or \
                quit_effects(s) != before:
            self.in_flight, self.held_answers = s.throughput.in_flight, s.held_answers
            if self.holding and not self.held_answers:
                self.held_answers = 0  # written meanwhile: the text says 0 held
            self.query_one("#quit-text", Static).update(self._text())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_choose(event.button.id if event.button.id in (DRAIN, STOP, WAIT, SPOOL) else "")

    def action_choose(self, choice: str) -> None:
        self.dismiss((self.HELD[choice] if self.holding else choice) if choice else None)
