"""The base of every panel: render one slice of the snapshot, and only when that slice changed."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from rich.console import RenderableType
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Static

from draftgen.core.live.snapshot import RunSnapshot

_NEVER = object()


class Panel(Static):
    """A `Static` fed with snapshots. Subclasses name the slice they read (`key`) and draw it (`draw`);
    a panel whose drawing depends on its own size says so in `fit` and is redrawn on resize. A panel
    shown only when it has something to say says when in `wanted`: it carries the `-hidden` class
    (the stylesheet hides it) otherwise."""

    TITLE: ClassVar[str] = ""
    FRAMED: ClassVar[bool] = True  # bordered per the stylesheet's .panel rules

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, classes="panel" if self.FRAMED else "")
        self.border_title = self.TITLE or None
        self.last: RunSnapshot | None = None
        self._key: Any = _NEVER
        self._shape: Any = _NEVER

    def show(self, snap: RunSnapshot) -> bool:
        """Redraw from `snap` if what this panel reads changed; say whether it did."""
        self.last = snap
        self.set_class(not self.wanted(snap), "-hidden")
        key = (self.key(snap), self.fit(), self.selection())
        if key == self._key:  # frozen dataclasses compare by value: unchanged slices cost no render
            return False
        self._key = key
        # Re-laying out the screen measures every panel; only ask for it when this one's height
        # may have changed (most updates are new numbers in the same rows).
        shape = (self.shape(snap), key[1])
        self.update(self.draw(snap), layout=shape != self._shape)
        self._shape = shape
        return True

    def shape(self, snap: RunSnapshot) -> Any:
        """What decides this panel's height; None for panels whose height the stylesheet fixes."""
        return None

    def on_resize(self) -> None:
        if self.last is not None:
            self.show(self.last)

    def key(self, snap: RunSnapshot) -> Any:
        return snap

    def wanted(self, snap: RunSnapshot) -> bool:
        """Whether the panel is shown for this snapshot."""
        return True

    def fit(self) -> Any:
        return None

    def selection(self) -> Any:
        """What of the cursor shows (selectable panels)."""
        return None

    def draw(self, snap: RunSnapshot) -> RenderableType:
        raise NotImplementedError

    @property
    def short(self) -> bool:
        """On a short screen (the stylesheet's -short class): panels keep to their essentials."""
        try:
            return self.screen.has_class("-short")
        except Exception:  # not mounted on a screen yet
            return False

    @property
    def rows(self) -> int:
        """Content rows available, or a generous default before the first layout."""
        return self.content_region.height or 12

    @property
    def cols(self) -> int:
        return self.content_region.width or 80


class DrillKind(StrEnum):
    """What a selectable panel's rows are, and so what enter drills into (the words show in titles)."""
    DATASET = "dataset"
    KIND = "error kind"
    PROVIDER = "provider"


class SelectablePanel(Panel):
    """A panel with a row cursor (arrows or j/k) once focused (tab); enter drills into the row."""

    can_focus = True
    WHAT: ClassVar[DrillKind]  # what a row is
    BINDINGS = [
        Binding("up,k", "move(-1)", "up", show=False),
        Binding("down,j", "move(1)", "down", show=False),
        Binding("enter", "open", "open"),
    ]

    class Open(Message):
        def __init__(self, what: DrillKind, name: str) -> None:
            super().__init__()
            self.what = what
            self.name = name

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cursor = 0

    def items(self, snap: RunSnapshot) -> tuple[str, ...]:
        """The names of the rows, in the order drawn."""
        return ()

    @property
    def selected(self) -> str | None:
        """The row under the cursor while focused, else None (nothing highlighted)."""
        if not self.has_focus or self.last is None:
            return None
        names = self.items(self.last)
        return names[min(self.cursor, len(names) - 1)] if names else None

    def selection(self) -> Any:
        return self.selected

    def _redraw(self) -> None:
        if self.last is not None:
            self.show(self.last)

    def on_focus(self) -> None:
        self._redraw()

    def on_blur(self) -> None:
        self._redraw()

    def action_move(self, step: int) -> None:
        if self.last is None:
            return
        n = len(self.items(self.last))
        self.cursor = max(0, min(n - 1, self.cursor + step)) if n else 0
        self._redraw()

    def action_open(self) -> None:
        if self.selected is not None:
            self.post_message(self.Open(self.WHAT, self.selected))
