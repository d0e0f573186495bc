"""Prompt files: JSONL or JSONL.gz, read as a stream, one prompt per line (its shape:
core/generate/loop/prompts.py).

A line that cannot be used becomes a `Rejection` (line number and reason); reading goes on. A file
with no usable line at all (empty, a JSON array, a pretty-printed object) is a PromptFileError at
its end: a run over it would otherwise end "complete" having asked nothing. A JSON array is refused,
not read: prompt files are streamed, and an array would have to be held whole in memory. (A run counts
each file before it starts; up to 20,000 prompts over all its datasets are then asked from what that
count parsed, the rest read again as a stream when their dataset starts: record_book.py
KEEP_SCANNED_PROMPTS.) A read runs in a thread and stops at its next line when the run quits
(`read_stoppable`).
"""

from __future__ import annotations

import asyncio
import gzip
import os
import stat
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import orjson

from draftgen.core.errors import NoPromptError, PromptFileError
from draftgen.core.generate.loop.prompts import Conversation, Prompt, Rejection, parse_conversation, parse_prompt

# One prompt line at most (64 MiB: far above any context window's worth of JSON); longer is rejected.
MAX_LINE_BYTES = 64 << 20


class ReadingStopped(Exception):
    """A prompt file's read was stopped (its `stop` event set: the run quits). Raised at the next line read,
    blank lines included: a file of a GiB of them is read for minutes in a thread, and a quit (Ctrl-C,
    SIGTERM) must not wait for it."""


T = TypeVar("T")


async def read_stoppable(read: Callable[[threading.Event], T]) -> T:
    """`read(stop)` in a thread. Cancelled (a stop now), it sets `stop`, so the read ends at its next
    line (ReadingStopped), waits for the thread to end (a thread left reading would hold the process's
    exit), and is cancelled."""
    stop = threading.Event()
    job = asyncio.ensure_future(asyncio.to_thread(read, stop))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({job})
        if not job.cancelled():
            job.exception()  # retrieved: ReadingStopped, or what the read met first
        raise


def _open(path: Path) -> BinaryIO:
    try:
        # O_NONBLOCK: opening a FIFO to read waits for a writer; refused below without waiting.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
        finally:
            os.close(fd)
        if not stat.S_ISREG(mode):
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            raise PromptFileError(f"{path}: not a regular file (a FIFO, device or socket): a prompt file must "
                                  f"be a JSONL(.gz) file on disk")
        with open(path, "rb") as probe:
            magic = probe.read(2)
        return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # type: ignore[return-value]
    except FileNotFoundError:
        raise PromptFileError(f"{path}: prompt file not found") from None
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a folder, not a prompt file") from None
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read: {e.strerror}") from None


_LINE_SHAPE = "one JSON object per line with an `id` and a `prompt`, `messages` or `conversations`"


def _no_prompt(path: Path, first: bytes | None, first_rejection: Rejection | None) -> NoPromptError:
    """The error for a file without one usable line, saying what the file looks like and what to do."""
    if first is None:
        return NoPromptError(f"{path}: no prompt in it (the file is empty): a prompt file is JSONL, {_LINE_SHAPE}")
    if first.lstrip().startswith(b"["):
        return NoPromptError(
            f"{path}: a JSON array, not JSONL: a prompt file holds {_LINE_SHAPE} (arrays are not read: "
            f"prompt files are streamed). Convert it: jq -c '.[]' {path} > {path.with_suffix('.jsonl')} "
            "and point the dataset's `prompts` at the new file")
    assert first_rejection is not None
    return NoPromptError(
        f"{path}: no usable prompt in it (line {first_rejection.line}: {first_rejection.reason}): a prompt "
        f"file holds {_LINE_SHAPE} (a pretty-printed file must be rewritten one object a line: jq -c)")


def read_prompts(path: Path, turns: str = "last", stop: threading.Event | None = None
                 ) -> Iterator[Prompt | Rejection]:
    """Every line of the file as a Prompt or a Rejection, streamed; duplicate ids are rejected. A file
    with no usable prompt raises PromptFileError once read to its end. `turns`: see parse_prompt. Once
    `stop` is set, the next line read raises ReadingStopped."""
    def parse(obj: Any, line_no: int) -> Prompt:
        pid, messages = parse_prompt(obj, turns)
        return Prompt(pid, messages, line_no)
    return _read_items(path, parse, stop)  # type: ignore[return-value]


def read_conversations(path: Path, max_turns: int | None = None, stop: threading.Event | None = None
                       ) -> Iterator[Conversation | Rejection]:
    """Every line of a turns = "all" file as a Conversation or a Rejection, streamed, as read_prompts."""
    def parse(obj: Any, line_no: int) -> Conversation:
        conv = parse_conversation(obj, max_turns)
        conv.line = line_no
        return conv
    return _read_items(path, parse, stop)  # type: ignore[return-value]


def read_dataset(path: Path, turns: str = "last", max_turns: int | None = None, stop: threading.Event | None = None
                 ) -> Iterator[Prompt | Conversation | Rejection]:
    """A dataset's file as its run reads it: Conversations for turns = "all" (a line may end with the
    dataset's own answer, dropped), else Prompts (read_prompts)."""
    if turns == "all":
        return read_conversations(path, max_turns, stop)
    return read_prompts(path, turns, stop)


def _read_items(path: Path, parse: Callable[[Any, int], Prompt | Conversation], stop: threading.Event | None
                ) -> Iterator[Prompt | Conversation | Rejection]:
    seen: set[str] = set()
    first: bytes | None = None  # the first non-blank line, to say what a file without a prompt is
    first_rejection: Rejection | None = None
    for item in _read_lines(path, seen, parse, stop):
        if isinstance(item, bytes):
            first = item
            continue
        if isinstance(item, Rejection) and first_rejection is None:
            first_rejection = item
        yield item
    if not seen:
        raise _no_prompt(path, first, first_rejection)


def _read_lines(path: Path, seen: set[str], parse: Callable[[Any, int], Prompt | Conversation],
                stop: threading.Event | None) -> Iterator[Prompt | Conversation | Rejection | bytes]:
    """read_prompts' items, and the first non-blank line (as bytes, before its item)."""
    with _open(path) as f:
        line_no = 0
        first = True
        while True:
            if stop is not None and stop.is_set():
                raise ReadingStopped(f"{path}: reading stopped at line {line_no + 1}")
            try:
                line = f.readline(MAX_LINE_BYTES + 1)
                too_long = len(line) > MAX_LINE_BYTES and not line.endswith(b"\n")
                rest = line if too_long else b""
                while rest and not rest.endswith(b"\n"):
                    rest = f.readline(1 << 20)  # the rest of a line too long to use, read and dropped by the MiB
            except (OSError, EOFError, zlib.error) as e:  # a corrupt or cut-short .gz (BadGzipFile is an OSError)
                raise PromptFileError(f"{path}: line {line_no + 1}: cannot read the file ({e})") from None
            if not line:
                return
            line_no += 1
            if too_long:
                if first:
                    first = False
                    yield line[:64]
                yield Rejection(line_no, None, f"line longer than {MAX_LINE_BYTES:,} bytes (not read whole)")
                continue
            if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a UTF-8 byte-order mark (some editors and exports write one)
            bad = ""  # why the line is not JSON
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                if not line.strip():  # a blank line (not JSON either): skipped
                    continue
                bad = "not valid UTF-8" if "utf-8" in str(e).lower() else f"not valid JSON ({e.msg})"
            if first:
                first = False
                yield line[:64]
            if bad:
                yield Rejection(line_no, None, bad)
                continue
            try:
                item = parse(obj, line_no)
            except ValueError as e:
                rid = obj.get("id") if isinstance(obj, dict) else None
                yield Rejection(line_no, None if rid is None else str(rid)[:200], str(e))
                continue
            if item.id in seen:
                yield Rejection(line_no, item.id, f"duplicate id {item.id!r}")
                continue
            seen.add(item.id)
            yield item
