"""Where a dataset's prompts come from: a *prompt source*, pulled by admission, told each outcome.

Admission (admission.py) asks the dataset's source for the next prompt ready to ask (`next`); the
request that asked it (request.py) tells the source, once, what became of it (`booked`) as soon as
its outcome is decided (its record written, or held while the disk refuses it). Every prompt `next`
yields is booked exactly once: by its request, or by admission when it never starts (a budget,
max_usd, a duplicate: SKIPPED; a drain, a stop, a stopped dataset: HANDED_BACK), or HANDED_BACK when
its request is cancelled (stop now) before it booked anything.

`Booked` says what became of the prompt:

- ANSWERED (with the `ChatAnswer`): its answer is recorded;
- FAILED (with the reason): failed for a reason of its own, or set aside by a 4xx naming no known
  cause (doubts.py: failed at the dataset's end, or left eligible when the dataset stops) — either
  way nothing more is asked after it this run;
- HANDED_BACK: not recorded, not its fault (an account condition, the disk refused the spend ledger,
  a drain or stop while retrying, its dataset stopped): it is yielded again by `next`, and admission
  asks it once the run may go on (a closed gate or a stopped dataset admits nothing more);
- SKIPPED (with the reason): a budget, max_usd, a duplicate of another dataset's prompt; counted
  skipped in DatasetRun, eligible for a later run.

The counts stay DatasetRun's (dataset_run.py): a source only decides which prompt comes next.
`FileSource` is a single-turn dataset's source: the prompts handed back first, then the file's next
ones not yet on disk. `open_source` picks a dataset's source from its config.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.loop.prompts import Prompt

if TYPE_CHECKING:
    from draftgen.core.generate.loop.dataset_run import DatasetRun
    from draftgen.core.generate.loop.record_book import RecordBook


class BookedAs(Enum):
    ANSWERED = "answered"        # the answer is recorded (Booked.answer)
    FAILED = "failed"            # failed as its own, or set aside (doubts.py): nothing more after it this run
    HANDED_BACK = "handed_back"  # not recorded, not its fault: `next` yields it again
    SKIPPED = "skipped"          # a budget, max_usd, a duplicate: counted skipped, eligible for a later run


# On Python 3.11 an Enum member read off its class goes through EnumType.__getattr__ (about 5x a module
# global's read): the kinds read on every request are read once, here.
_ANSWERED, _HANDED_BACK = BookedAs.ANSWERED, BookedAs.HANDED_BACK


@dataclass(slots=True)  # one per answered request: a frozen __init__ costs 3x (setattr per field)
class Booked:
    """What became of a prompt `next` yielded (see the module docstring)."""
    kind: BookedAs
    answer: ChatAnswer | None = None
    reason: str = ""  # FAILED and SKIPPED: why

    @staticmethod
    def answered(answer: ChatAnswer) -> Booked:
        return Booked(_ANSWERED, answer)

    @staticmethod
    def failed(reason: str) -> Booked:
        return Booked(BookedAs.FAILED, reason=reason)

    @staticmethod
    def skipped(reason: str) -> Booked:
        return Booked(BookedAs.SKIPPED, reason=reason)


HANDED_BACK = Booked(BookedAs.HANDED_BACK)  # carries nothing: one for every prompt handed back
TAKEN_ELSEWHERE = Booked.skipped("already answered (or being answered) in another dataset")  # duplicates.py


class PromptSource(Protocol):
    async def next(self) -> Prompt | None:
        """The next prompt ready to ask (it may wait for an outcome to be booked); None: nothing more, ever."""
        ...

    def booked(self, prompt: Prompt, result: Booked) -> None:
        """What became of a prompt `next` yielded; called once, as soon as its outcome is decided."""
        ...


class FileSource:
    """A single-turn dataset's prompts: those handed back first (in the order they came back), then the
    file's next ones not yet on disk. Once the file is read, `next` waits while prompts it yielded are
    not booked (any may come back), and returns None when none is out and none was handed back."""

    def __init__(self, chunks: AsyncIterator[list[Prompt]]) -> None:
        self._file: AsyncIterator[list[Prompt]] | None = chunks  # the file's prompts by the chunk; None once read
        self._chunk: deque[Prompt] = deque()  # the rest of the chunk read last
        self._back: deque[Prompt] = deque()
        self._out = 0  # yielded, not booked yet
        self._booked = asyncio.Event()  # set on a booking while a `next` waits at the file's end
        self._waiting = False  # a `next` waits on `_booked` (else a booking sets nothing: no call per request)

    @property
    def out(self) -> int:
        """Prompts yielded and not booked yet."""
        return self._out

    @property
    def handed_back(self) -> int:
        """Prompts handed back, waiting to be yielded again."""
        return len(self._back)

    async def next(self) -> Prompt | None:
        while True:
            if self._back:
                self._out += 1
                return self._back.popleft()
            if self._chunk:
                self._out += 1
                return self._chunk.popleft()
            if self._file is not None:
                chunk = await anext(self._file, None)
                if chunk is None:
                    self._file = None
                else:
                    self._chunk.extend(chunk)
                continue
            if not self._out:
                return None
            self._booked.clear()
            self._waiting = True
            try:
                await self._booked.wait()
            finally:
                self._waiting = False

    def booked(self, prompt: Prompt, result: Booked) -> None:
        self._out -= 1
        if result.kind is _HANDED_BACK:
            self._back.append(prompt)
        if self._waiting:
            self._booked.set()


def open_source(ds: DatasetRun, book: RecordBook) -> PromptSource:
    """The dataset's prompt source: its file streamed (ids already on disk skipped), plus the requeue."""
    return FileSource(book.prompts(ds))
