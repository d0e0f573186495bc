"""A question before a stage starts (the `m` and `x` keys when hidden states are at stake): the
situation in words, one button and key per choice, and cancel. Dismisses with the chosen key's
value, or None."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static


@dataclass(frozen=True)
class Choice:
    key: str        # the key that chooses it (also the button's id)
    value: str      # what the dialog dismisses with
    label: str      # the button
    effect: str     # one line: what it does
    variant: str = "primary"


class ChoiceScreen(ModalScreen[str | None]):
    def __init__(self, title: str, question: str, text: str, choices: tuple[Choice, ...]) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.question = question
        self.text = text
        self.choices = choices
        self._bindings.bind("escape,c", "choose('')", "cancel")
        for c in choices:
            self._bindings.bind(c.key, f"choose({c.value!r})", c.label.lower())

    BINDINGS = [Binding("escape,c", "choose('')", "cancel")]

    def compose(self) -> ComposeResult:
        parts: list[str | tuple[str, str]] = [(self.question, "bold"), " ", self.text, "\n\n"]
        for c in self.choices:
            parts += [(f"{c.key}  {c.label.lower()}", "bold"), f"  {c.effect}\n"]
        parts += [("esc  cancel", "bold"), "  nothing is changed"]
        with Vertical(id="choice-dialog", classes="dialog") as box:
            box.border_title = self.title_text
            yield Static(Text.assemble(*parts), id="choice-text")
            with Horizontal(id="choice-buttons"):
                for c in self.choices:
                    yield Button(f"{c.label} ({c.key})", id=f"choice-{c.value}", variant=c.variant)  # type: ignore[arg-type]
                yield Button("Cancel (esc)", id="choice-cancel")
        yield Footer(compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        value = (event.button.id or "").removeprefix("choice-")
        self.action_choose("" if value == "cancel" else value)

    def action_choose(self, value: str) -> None:
        self.dismiss(value or None)


MERGE_ANYWAY = (Choice("m", "merge", "Merge", "merge now; hidden states of another merge are set aside"),)
OTHER_MERGE = (Choice("s", "start_over", "Start over", "delete those files and extract this merge", "error"),
               Choice("a", "set_aside", "Set aside", "move them aside (nothing deleted) and extract this merge",
                      "warning"))
