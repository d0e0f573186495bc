"""Prompt files: JSONL or JSONL.gz, read as a stream, one prompt per line.

Each line is an object with an `id` (string or integer, unique within the dataset; integers are
kept as their decimal string) and one of:
- `prompt`: a string, sent as one user message;
- `messages`: OpenAI-style list, the last message from the user;
- `conversations`: ShareGPT/SpecForge style (`role`/`content` or `from`/`value`); the turns up to the
  last user turn are the prompt, later assistant turns are dropped (they are regenerated).

A line that cannot be used becomes a `Rejection` (line number and reason); reading goes on. A file
with no usable line at all (empty, a JSON array, a pretty-printed object) is a PromptFileError at
its end: a run over it would otherwise end "complete" having asked nothing. A JSON array is refused,
not read: prompt files are streamed, and an array would have to be held whole in memory.
"""

from __future__ import annotations

import gzip
import os
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from draftgen.core.errors import NoPromptError, PromptFileError

# One prompt line at most (64 MiB: far above any context window's worth of JSON); longer is rejected.
MAX_LINE_BYTES = 64 << 20

_ROLE_ALIASES = {
    "user": "user", "human": "user", "system": "system",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant", "bot": "assistant",
}


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    line: int


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class Rejection:
    line: int
    id: str | None
    reason: str


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


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: only text parts can be sent to a text-only target.
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where} content must be a string (or text parts)")


def parse_turns(raw: Any, key: str) -> list[dict[str, str]]:
    """A `messages`/`conversations` list as role/content turns (roles normalised), or ValueError."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"`{key}` must be a non-empty list")
    turns = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise ValueError(f"{key}[{i}] must be an object")
        # An Arrow struct column holds every key seen in the column, absent ones as null.
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        norm = _ROLE_ALIASES.get(role) if isinstance(role, str) else None
        if norm is None:
            raise ValueError(f"{key}[{i}] has an unknown role {role!r}")
        turns.append({"role": norm, "content": _text(content, f"{key}[{i}]")})
    return turns


def parse_prompt(obj: Any) -> tuple[str, list[dict[str, str]]]:
    """(id, messages) from one decoded line, or ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("line is not a JSON object")
    raw_id = obj.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
        raise ValueError("missing `id` (a string or integer)" if raw_id is None else f"bad id {raw_id!r}")
    pid = str(raw_id)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError("`prompt` must be a non-empty string")
        return pid, [{"role": "user", "content": obj["prompt"]}]
    if "messages" in obj:
        messages = parse_turns(obj["messages"], "messages")
        if messages[-1]["role"] != "user":
            raise ValueError("the last message must be from the user")
        return pid, messages
    if "conversations" in obj:
        turns = parse_turns(obj["conversations"], "conversations")
        last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
        if last_user < 0:
            raise ValueError("`conversations` has no user turn")
        return pid, turns[: last_user + 1]
    raise ValueError("no `prompt`, `messages` or `conversations`")


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


def read_prompts(path: Path) -> Iterator[Prompt | Rejection]:
    """Every line of the file as a Prompt or a Rejection, streamed; duplicate ids are rejected. A file
    with no usable prompt raises PromptFileError once read to its end."""
    seen: set[str] = set()
    first: bytes | None = None  # the first non-blank line, to say what a file without a prompt is
    first_rejection: Rejection | None = None
    for item in _read_lines(path, seen):
        if isinstance(item, bytes):
            first = item
            continue
        if isinstance(item, Rejection) and first_rejection is None:
            first_rejection = item
        yield item
    if not seen:
        raise _no_prompt(path, first, first_rejection)


def _read_lines(path: Path, seen: set[str]) -> Iterator[Prompt | Rejection | bytes]:
    """read_prompts' items, and the first non-blank line (as bytes, before its item)."""
    with _open(path) as f:
        line_no = 0
        first = True
        while True:
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
            if not line.strip():
                continue
            if first:
                first = False
                yield line[:64]
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                reason = "not valid UTF-8" if "utf-8" in str(e).lower() else f"not valid JSON ({e.msg})"
                yield Rejection(line_no, None, reason)
                continue
            try:
                pid, messages = parse_prompt(obj)
            except ValueError as e:
                rid = obj.get("id") if isinstance(obj, dict) else None
                yield Rejection(line_no, None if rid is None else str(rid)[:200], str(e))
                continue
            if pid in seen:
                yield Rejection(line_no, pid, f"duplicate id {pid!r}")
                continue
            seen.add(pid)
            yield Prompt(pid, messages, line_no)
