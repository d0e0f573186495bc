"""A conversation of a turns = "all" dataset shown step by step, read from its responses.jsonl.

The dataset drill-down shows one: the user and system turns, each step's answer (its content, the
tool calls it made: name and arguments), the tool results sent after them (matched or replayed, with
the call id they went under), and where it diverged (docs/agents.md). A step's record holds the
history sent for it, so the record of the highest step read carries the whole conversation; the
records of the earlier steps add their own flags. Only the file's tail is read (TAIL_BYTES): the view
browses the conversations whose records are there, newest last. Every text is the dataset's or a
server's: shown through `visible` and as rich Text, never markup, and cut at TEXT_CHARS.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from draftgen.core.records import StoredResponse, count_of, stored_response
from draftgen.core.safe_text import visible

TAIL_BYTES = 2 << 20   # the end of responses.jsonl that is read: its last few hundred agent steps
TAIL_MAX_BYTES = 32 << 20  # read up to this much when the tail holds no whole record (a long trajectory's)
TEXT_CHARS = 400       # a message's text shown at most (a tool result may be a whole file)


@dataclass(frozen=True)
class ShownConversation:
    """The records of one conversation found in the file's tail, by step (1-based `turn`)."""
    id: str
    steps: tuple[StoredResponse, ...]   # ordered by step; the earliest may be missing (before the tail)

    @property
    def last(self) -> StoredResponse:
        return self.steps[-1]


def read_tail(path: Path, limit: int = TAIL_BYTES) -> list[StoredResponse]:
    """The records of the last `limit` bytes of a responses file, in file order: the line cut by the
    tail's start, a half-written last line and any line that is not a JSON object are left out. A tail
    that holds no whole record is read again four times longer, up to TAIL_MAX_BYTES. A missing file
    has none."""
    while True:
        records, start = _read_tail(path, limit)
        if records or start == 0 or limit >= TAIL_MAX_BYTES:
            return records
        limit = min(4 * limit, TAIL_MAX_BYTES)


def _read_tail(path: Path, limit: int) -> tuple[list[StoredResponse], int]:
    """The records of the file's last `limit` bytes, and where they start (0: the whole file)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - limit)
            f.seek(start)
            data = f.read(size - start)
    except OSError:
        return [], 0
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # begun before the tail
    records = []
    for line in lines:
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            records.append(stored_response(obj))
    return records, start


def conversations(records: Iterable[StoredResponse]) -> list[ShownConversation]:
    """The conversations of these records (those with a `conversation` and a `turn`), ordered by their
    newest record's place in the file: the last one is the one answered most recently."""
    found: dict[str, dict[int, StoredResponse]] = {}
    for r in records:
        conv, turn = r.get("conversation"), count_of(r.get("turn"))
        if not isinstance(conv, str) or turn < 1:
            continue
        steps = found.pop(conv, {})  # popped and put back: the dict keeps the newest last
        steps[turn] = r
        found[conv] = steps
    return [ShownConversation(conv, tuple(steps[k] for k in sorted(steps))) for conv, steps in found.items()]


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _text(value: Any, *, limit: int = TEXT_CHARS) -> str:
    """A message's text (a string, or OpenAI content parts), control characters escaped, cut at `limit`."""
    if isinstance(value, list):
        value = "".join(p.get("text", "") for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(value, str):
        return ""
    text = value.strip()
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text) - limit:,} more characters)"
    return visible(text)


def _calls(calls: Any) -> list[Text]:
    """One line per tool call: → name(arguments) [id], the arguments as the answer wrote them."""
    lines = []
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        name = _str(fn.get("name")) or "?"
        args = fn.get("arguments")
        args = args if isinstance(args, str) else orjson.dumps(args).decode() if args is not None else ""
        call_id = _str(call.get("id") if isinstance(call, dict) else None)
        lines.append(Text.assemble(("→ ", "bold cyan"), (visible(name, one_line=True), "bold"),
                                   ("(", "dim"), _text(args, limit=200), (")", "dim"),
                                   (f"  {visible(call_id, one_line=True)}" if call_id else "", "dim")))
    return lines


def _reasoning_chars(m: Mapping[str, object]) -> int:
    """The length of a message's reasoning: its text (`reasoning`, `reasoning_content`), else the text of
    its OpenRouter `reasoning_details` (how a history message sends it back)."""
    for key in ("reasoning", "reasoning_content"):
        if isinstance(text := m.get(key), str) and text.strip():
            return len(text)
    details = m.get("reasoning_details")
    return sum(len(d.get("text") or d.get("summary") or "") for d in details if isinstance(d, dict)
               and isinstance(d.get("text") or d.get("summary") or "", str)) if isinstance(details, list) else 0


def _answer(m: Mapping[str, object]) -> RenderableType:
    """An answer (a record's or a history message): its reasoning's length, its content and its calls."""
    content, calls = m.get("content"), m.get("tool_calls")
    parts: list[RenderableType] = []
    if n := _reasoning_chars(m):
        parts.append(Text(f"(reasoning: {n:,} characters)", style="dim"))
    text = _text(content)
    if text:
        parts.append(Text(text))
    parts.extend(_calls(calls))
    if not parts:
        parts.append(Text("(empty)", style="dim"))
    return Group(*parts)


def _results_flag(record: StoredResponse | None, before: StoredResponse | None, first: bool) -> tuple[str, str]:
    """How the tool results just before a step were sent, from the `tool_results` of its record (which
    says how all the results in its history were: "replayed" when any was) and of the step before
    (`first`: there is none with results)."""
    how = record.get("tool_results") if record is not None else None
    if how == "matched":
        return "the dataset's result, sent under the target's call id", "dim"
    if how == "replayed":
        if not first and (before is None or before.get("tool_results") == "replayed"):  # an earlier one was
            return "the dataset's result (tool_results = \"replay\")", "yellow"
        return "replayed: the dataset's result after other calls than the dataset's", "yellow"
    return "", ""


def draw_conversation(c: ShownConversation, *, position: str = "") -> RenderableType:
    """The conversation step by step from its newest record's history and answer."""
    last = c.last
    by_step = {count_of(r.get("turn")): r for r in c.steps}
    step_n = count_of(last.get("turn"))
    total = count_of(last.get("turns"))
    diverged = last.get("diverged") is True
    head = Text.assemble(("conversation ", "dim"), (visible(c.id, one_line=True), "bold"),
                         f"  {step_n} of {total} steps answered" if total else f"  {step_n} steps answered",
                         (f"  diverged at step {step_n}", "bold yellow") if diverged else "",
                         (f"  ({position})", "dim") if position else "")
    grid = Table.grid(padding=(0, 1, 0, 0))
    grid.add_column(no_wrap=True, min_width=10)
    grid.add_column(ratio=1)
    step = 0
    messages = last.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "assistant":
            step += 1
            grid.add_row(Text(f"step {step}", style="bold green"), _answer(m))
        elif role == "tool":
            note, style = _results_flag(by_step.get(step + 1), by_step.get(step), step == 1)
            call_id = _str(m.get("tool_call_id"))
            grid.add_row(Text("  result", style="cyan"), Group(
                Text.assemble((f"← {visible(call_id, one_line=True)}", "cyan"), (f"  {note}" if note else "", style)),
                Text(_text(m.get("content")))))
        elif role in ("user", "system"):
            grid.add_row(Text(str(role), style="bold"), Text(_text(m.get("content"))))
    grid.add_row(Text(f"step {step_n}", style="bold green"),
                 _answer(last))
    if diverged:
        grid.add_row("", Text("diverged: not the dataset's next move; this answer is a sample, nothing more "
                              "was asked", style="yellow"))
    return Group(head, grid)


def pick(found: Sequence[ShownConversation], pinned: str | None) -> int | None:
    """The index of the conversation to show: the pinned one while the tail still holds it, else the
    newest; None when there is none."""
    if not found:
        return None
    if pinned is not None:
        for i, c in enumerate(found):
            if c.id == pinned:
                return i
    return len(found) - 1
