"""One request, from its admission to its record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.loop.source import Booked, PromptSource

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun


class Request:
    """One admitted prompt in flight: its dataset, its prompt and the source to tell its outcome, once."""
    __slots__ = ("ds", "prompt", "source", "booked")

    def __init__(self, ds: DatasetRun, prompt: Prompt, source: PromptSource) -> None:
        self.ds = ds
        self.prompt = prompt
        self.source = source
        self.booked = False

    def book(self, result: Booked) -> None:
        """Tell the source what became of the prompt (the first outcome booked is the one)."""
        if not self.booked:
            self.booked = True
            self.source.booked(self.prompt, result)
