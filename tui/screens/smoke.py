"""The smoke-test modal: the checklist of the "smoke" stage, filled in as its rows arrive."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from draftgen.core.live.snapshot import RunSnapshot, StageProgress

VERDICTS = {"running": ("running…", "bold yellow"), "done": ("PASSED", "bold black on green"),
            "failed": ("FAILED", "bold white on red"), "idle": ("starting…", "bold")}


def draw_smoke(stage: StageProgress | None) -> RenderableType:
    if stage is None:
        return Text("waiting for the smoke test to start…", style="dim")
    label, style = VERDICTS.get(stage.state, (stage.state, "bold"))
    head = Text.assemble(("verdict ", "bold"), (f" {label} ", style))
    table = Table(box=None, expand=True, padding=(0, 1, 0, 0), show_header=False, show_edge=False)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(ratio=1, overflow="fold")
    for check, passed, reason in stage.checks:
        mark = Text("✓ pass", style="bold green") if passed else Text("✗ FAIL", style="bold red")
        table.add_row(mark, Text(check), Text(reason, style="" if passed else "red"))
    if stage.state == "running":
        table.add_row(Text("… ", style="dim"), Text("checking", style="dim"), "")
    parts: list[RenderableType] = [head, Text(""), table]
    if stage.detail:
        details = Table.grid(padding=(0, 2, 0, 0))
        details.add_column(style="bold", no_wrap=True)
        details.add_column()
        for k, v in stage.detail:
            details.add_row(Text(k), Text(v))  # text, not Rich markup
        parts += [Text(""), details]
    if stage.message:
        parts += [Text(""), Text(stage.message)]
    return Group(*parts)


class SmokeScreen(ModalScreen[None]):
    """Shows the latest "smoke" stage; the app hands it every new snapshot while it is open."""

    BINDINGS = [Binding("escape", "close", "close"), Binding("enter", "close", "close", show=False)]

    def __init__(self, snap: RunSnapshot | None) -> None:
        super().__init__(classes="dialog-screen")
        self._stage = snap.stage("smoke") if snap else None

    def compose(self) -> ComposeResult:
        with Vertical(id="smoke-dialog", classes="dialog") as box:
            box.border_title = "smoke test"
            yield Static(draw_smoke(self._stage), id="smoke-body")
            yield Static(Text("esc close", style="dim"), classes="dialog-hint")
        yield Footer(compact=True)

    def show(self, snap: RunSnapshot) -> None:
        stage = snap.stage("smoke")
        if stage == self._stage:
            return
        self._stage = stage
        self.query_one("#smoke-body", Static).update(draw_smoke(stage))

    def action_close(self) -> None:
        self.dismiss(None)
