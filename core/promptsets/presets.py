"""From a dataset row to the prompt messages: presets for the common layouts and an explicit mapping.

Only the prompt side is kept; the dataset's own answers are dropped (the target regenerates them):
- `sharegpt`: a `conversations` list of `{from, value}` (or `{role, content}`) turns;
- `openai`: a `messages` list of `{role, content}`;
- `instruction`: `instruction` plus an optional `input` (Alpaca and its descendants), joined by a
  blank line; `output` is dropped;
- `text`: one text column sent as the user message;
- `trajectory`: a `trajectory` list of agent turns (SWE-agent's `{role, text}`, or OpenAI messages).

With `turns="all"`, a conversation with a tool loop (assistant `tool_calls`, `tool` results, ShareGPT
`function_call`/`observation` turns) is kept whole in the OpenAI layout through its last assistant
message, with the row's `tools` column as its `tools` (core/promptsets/agents.py): every assistant
message is then a step the target answers. Other `turns` keep cutting it before its first tool turn.

For conversations, `turns="first"` keeps a leading system turn and the first user turn (the
dataset's later turns were answered by another model); `turns="last"` keeps everything up to the
last user turn as history, as the engine does for a `conversations` prompt file. `turns="all"` keeps
the conversation as the source has it up to its last user turn (at most `max_turns` user turns), cut
before its first tool turn (a `tool`/`function` message or an assistant turn with `tool_calls`: the
engine regenerates the user turns before it only); the dataset's assistant turns stay in the file,
so it reads the same under any `turns`, and a `turns = "all"` dataset drops them when it reads it
(every user turn is then asked on the target's own earlier answers).

An explicit mapping names the columns: `prompt=COL` (with `system=COL` and `input=COL` optional),
or `messages=COL` / `conversations=COL`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from draftgen.core.bodies import plain_messages
from draftgen.core.errors import DraftgenError
from draftgen.core.generate.loop.prompts import TOOL_ROLES, parse_turns
from draftgen.core.promptsets import agents

PRESETS = ("sharegpt", "openai", "instruction", "text", "trajectory")
# Column names a `text` preset looks for, in this order, when no column is named.
TEXT_COLUMNS = ("prompt", "question", "problem", "query", "instruction", "input", "text")

class MappingError(DraftgenError):
    """A preset or mapping that does not fit the dataset's columns."""


@dataclass(frozen=True)
class FieldMapping:
    """Which columns make the prompt. `kind` is the shape; the column names are the dataset's."""

    kind: Literal["conversations", "instruction", "text"]
    column: str                 # conversations/messages list, instruction, or text column
    input: str | None = None    # instruction: the optional input column; text: an optional second part
    system: str | None = None   # an optional system-prompt column
    turns: Literal["first", "last", "all"] = "first"
    max_turns: int | None = None  # turns="all": user turns kept per conversation at most
    tools: str | None = None    # conversations: the column of the line's tool schemas (agent lines)

    def describe(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in (("input", self.input), ("system", self.system)) if v)
        return f"{self.kind}({self.column}{extra})"


def parse_mapping(text: str) -> dict[str, str]:
    """`prompt=question,system=sys` → {"prompt": "question", "system": "sys"}, or MappingError."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, column = part.partition("=")
        key, column = key.strip(), column.strip()
        if not sep or not key or not column:
            raise MappingError(f"--map {text!r}: expected KEY=COLUMN[,KEY=COLUMN], e.g. prompt=question,system=sys")
        if key not in ("prompt", "input", "system", "messages", "conversations", "tools"):
            raise MappingError(f"--map {text!r}: unknown key {key!r} (known: prompt, input, system, messages, "
                               f"conversations, tools)")
        out[key] = column
    return out


def _need(columns: Sequence[str], column: str, what: str) -> str:
    if column not in columns:
        raise MappingError(f"{what}: the dataset has no column {column!r} (columns: {', '.join(columns)})")
    return column


def resolve(columns: Sequence[str], *, preset: str | None, mapping: Mapping[str, str] | None,
            turns: Literal["first", "last", "all"] = "first", label: str = "dataset",
            max_turns: int | None = None) -> FieldMapping:
    """The FieldMapping for a dataset with `columns`: explicit mapping, named preset, or detected."""
    m = _resolve(columns, preset=preset, mapping=mapping, turns=turns, label=label)
    return dataclasses.replace(m, max_turns=max_turns) if m.kind == "conversations" else m


def _resolve(columns: Sequence[str], *, preset: str | None, mapping: Mapping[str, str] | None,
             turns: Literal["first", "last", "all"], label: str) -> FieldMapping:
    cols = list(columns)
    if mapping:
        lists = [k for k in ("messages", "conversations") if k in mapping]
        if lists and "prompt" in mapping:
            raise MappingError(f"{label}: --map names both prompt and {lists[0]}; use one")
        if len(lists) > 1:
            raise MappingError(f"{label}: --map names both messages and conversations; use one")
        system = _need(cols, mapping["system"], label) if "system" in mapping else None
        if lists:
            tools = _need(cols, mapping["tools"], label) if "tools" in mapping else None
            return FieldMapping("conversations", _need(cols, mapping[lists[0]], label), system=system, turns=turns,
                                tools=tools)
        if "prompt" not in mapping:
            raise MappingError(f"{label}: --map needs prompt=COLUMN (or messages=/conversations=COLUMN)")
        inp = _need(cols, mapping["input"], label) if "input" in mapping else None
        return FieldMapping("text", _need(cols, mapping["prompt"], label), input=inp, system=system)
    if preset is None or preset == "auto":
        preset = detect(cols, label)
    system = "system" if "system" in cols else None
    tools = "tools" if "tools" in cols else None
    if preset == "sharegpt":
        return FieldMapping("conversations", _need(cols, "conversations", f"{label} (preset sharegpt)"),
                            system=system, turns=turns, tools=tools)
    if preset == "openai":
        return FieldMapping("conversations", _need(cols, "messages", f"{label} (preset openai)"),
                            system=system, turns=turns, tools=tools)
    if preset == "trajectory":
        return FieldMapping("conversations", _need(cols, "trajectory", f"{label} (preset trajectory)"),
                            system=system, turns=turns, tools=tools)
    if preset == "instruction":
        return FieldMapping("instruction", _need(cols, "instruction", f"{label} (preset instruction)"),
                            input="input" if "input" in cols else None, system=system)
    if preset == "text":
        column = next((c for c in TEXT_COLUMNS if c in cols), None)
        if column is None:
            raise MappingError(f"{label} (preset text): none of the columns {', '.join(TEXT_COLUMNS)} is here "
                               f"(columns: {', '.join(cols)}); name one with --map prompt=COLUMN")
        return FieldMapping("text", column, system=system)
    raise MappingError(f"unknown preset {preset!r} (known: auto, {', '.join(PRESETS)})")


def detect(columns: Sequence[str], label: str = "dataset") -> str:
    """The preset a dataset's columns suggest, or MappingError listing the columns."""
    if "conversations" in columns:
        return "sharegpt"
    if "messages" in columns:
        return "openai"
    if "trajectory" in columns:
        return "trajectory"
    if "instruction" in columns:
        return "instruction"
    if any(c in columns for c in TEXT_COLUMNS):
        return "text"
    raise MappingError(f"{label}: cannot tell the layout from the columns ({', '.join(columns)}); choose "
                       f"--preset or name the columns with --map prompt=COLUMN")


def before_tools(raw: Any) -> Any:
    """A conversation list cut before its first tool turn: a tool result message, or an assistant turn
    with `tool_calls` (regenerating past it would send a half-formed tool loop)."""
    if not isinstance(raw, list):
        return raw
    for i, turn in enumerate(raw):
        if isinstance(turn, dict) and (turn.get("tool_calls") or
                                       (turn.get("role") if turn.get("role") is not None else turn.get("from"))
                                       in TOOL_ROLES):
            return raw[:i]
    return raw


def _agent_turns(raw: Any, column: str, max_turns: int | None) -> list[dict[str, Any]]:
    """A tool-loop conversation whole, in OpenAI layout (at most `max_turns` user turns)."""
    out = agents.agent_messages(raw, column)
    if max_turns is not None:
        users = [i for i, t in enumerate(out) if t["role"] == "user"]
        if len(users) > max_turns:
            out = out[:users[max_turns]]
            last = max(i for i, t in enumerate(out) if t["role"] == "assistant")
            out = out[:last + 1]
    return out


def _turns(raw: Any, column: str, turns: str, max_turns: int | None = None) -> list[dict[str, Any]]:
    raw = agents.swe_agent_turns(raw, column)
    if turns == "all" and agents.is_agent(raw):
        return _agent_turns(raw, column, max_turns)
    cut = before_tools(raw)
    if isinstance(raw, list) and raw and not cut:
        raise ValueError(f"`{column}` has no user turn before its first tool turn")
    if turns == "all" and isinstance(raw, list) and not raw:
        raise ValueError(f"`{column}` is empty")
    out = plain_messages(parse_turns(cut, column))
    users = [i for i, t in enumerate(out) if t["role"] == "user"]
    if not users:
        raise ValueError(f"`{column}` has no user turn")
    if turns == "first":
        # A leading system turn stays; the first user turn is the prompt.
        return [t for t in out[:users[0]] if t["role"] == "system"] + [out[users[0]]]
    if turns == "all" and max_turns is not None:
        users = users[:max_turns]
    return out[: users[-1] + 1]


def to_line(row: Mapping[str, Any], m: FieldMapping) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages of one row and, for an agent line (one with tool calls), its `tools`."""
    messages = to_messages(row, m)
    agent = any(t.get("tool_calls") or t["role"] == "tool" for t in messages)
    return messages, agents.parse_tools(row.get(m.tools), m.tools) if agent and m.tools else None


def to_messages(row: Mapping[str, Any], m: FieldMapping) -> list[dict[str, Any]]:
    """The prompt messages of one row (prompt side only, or an agent line whole), or ValueError."""
    if m.kind == "conversations":
        messages = _turns(row.get(m.column), m.column, m.turns, m.max_turns)
    else:
        text = row.get(m.column)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"`{m.column}` is empty or not text")
        extra = row.get(m.input) if m.input else None
        if isinstance(extra, str) and extra.strip():
            text = f"{text}\n\n{extra}"
        messages = [{"role": "user", "content": text}]
    system = row.get(m.system) if m.system else None
    if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    if not any(t["content"].strip() for t in messages if t["role"] == "user"):
        raise ValueError("the user turn is empty")
    return messages
