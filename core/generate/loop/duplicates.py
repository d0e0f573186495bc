"""Cross-dataset duplicates at run time: a prompt already answered (or being answered) in another
dataset of the run directory is not sent again.

Two datasets drawn from overlapping sources often share prompts; merge would keep only one of the
two answers (core/dedupe.py `prompt_key`, the same key), so the second is money spent for nothing.
A prompt counts as taken by a dataset when its `prompt_key` is in that dataset's responses.jsonl
(read at the start of the run, every dataset folder of the run directory, not only those in the
config), or when that dataset has it in flight or answered it during this run. The check is made in
the event loop right before a request starts, so two datasets running in parallel never both send it.
A skipped prompt is written nowhere (like every skip): if its twin fails for good, the next run
sends it. Within one dataset a repeated prompt is not this module's business (ids are the contract).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from draftgen.core.bodies import ChatMessage
from draftgen.core.dedupe import prompt_key, record_key, turn_key
from draftgen.core.records import stored_responses


def answered_keys(folders: Iterable[tuple[str, Path]]) -> dict[bytes, str]:
    """`prompt_key` → the first dataset whose responses.jsonl holds it, over (name, responses path) pairs."""
    owners: dict[bytes, str] = {}
    for name, path in folders:
        for _, record in stored_responses(path):
            if isinstance(record.get("messages"), list):
                owners.setdefault(record_key(record), name)  # a conversation turn: its prompt side (dedupe.py)
    return owners


class CrossDatasetDuplicates:
    """Which dataset owns each prompt: answered (on disk or this run) or in flight."""

    def __init__(self) -> None:
        self._answered: dict[bytes, str] = {}
        self._sending: dict[bytes, str] = {}
        self._keys: dict[tuple[str, str], bytes] = {}   # (dataset, prompt id) in flight → its key
        self.skipped: dict[str, int] = {}   # per dataset, prompts skipped as taken elsewhere
        self.needed = True                  # false after `load` when the run directory has one dataset

    def load(self, root: Path, order: Iterable[str]) -> None:
        """Read the answers on disk: config datasets first (in order), then any other dataset folder."""
        names = list(order)
        others = sorted(p.parent.name for p in root.glob("*/responses.jsonl") if p.parent.name not in names)
        self.needed = len(names) + len(others) > 1
        if self.needed:
            self._answered = answered_keys((n, root / n / "responses.jsonl") for n in [*names, *others])

    def claim(self, dataset: str, prompt_id: str, messages: list[ChatMessage], *, turn: bool = False) -> str | None:
        """The other dataset that answered or is sending this prompt (then it must not go out), or None:
        then it is `dataset`'s, in flight, until `settled`. `turn`: a turn of a `turns = "all"` conversation,
        keyed on its prompt side (dedupe.turn_key), not on the target's earlier answers in its history."""
        key = turn_key(messages) if turn else prompt_key(messages)
        owner = self._answered.get(key) or self._sending.get(key)
        if owner is not None and owner != dataset:
            return owner
        self._sending.setdefault(key, dataset)
        self._keys[(dataset, prompt_id)] = key
        return None

    def skip(self, dataset: str) -> int:
        self.skipped[dataset] = self.skipped.get(dataset, 0) + 1
        return self.skipped[dataset]

    def answered(self, dataset: str, prompt_id: str) -> None:
        key = self._keys.get((dataset, prompt_id))
        if key is not None:
            self._answered.setdefault(key, dataset)

    def settled(self, dataset: str, prompt_id: str) -> None:
        """The request ended (answered, failed or given up): it no longer holds the prompt in flight."""
        key = self._keys.pop((dataset, prompt_id), None)
        if key is not None and self._sending.get(key) == dataset:
            del self._sending[key]
