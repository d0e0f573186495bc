"""What makes two prompts the same prompt: one definition for the prompt builder, `run` and merge.

Two keys, both 16-byte blake2b digests of the prompt messages (the prompt side only, never an
answer):
- `exact_key`: the messages as sent, in canonical JSON (keys sorted). Same key, same request body.
- `prompt_key`: the messages' roles and their *normalised* text. Prompts that differ only in
  Unicode form (NFKC: full-width letters, ligatures, non-breaking spaces), letter case, or the
  amount and kind of whitespace get one key: the target model would answer them alike, so paying
  for both buys a near-copy of a training sample. Roles stay in the key (the same words as a system
  prompt and as a user turn are different prompts), and so do tool calls of earlier turns.

The builder (`draftgen prompts build`) drops both kinds before writing prompt files, `run` skips a
prompt whose `prompt_key` was already answered in another dataset of the run directory, and merge
keeps the first sample of each `prompt_key`.

A turn of a `turns = "all"` conversation (a record with a `turn`) is keyed on the conversation's
prompt side up to that turn, `turn_key`: its system turn and user turns 1..k, never the target's
earlier answers in its history (they differ from run to run, so they would make every turn unique).
Two conversations that open alike share their first turns' keys; a single-turn prompt equal to a
conversation's first user turn shares that turn's key.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

import orjson

_SPACE = re.compile(r"\s+")


def normalise_text(text: str) -> str:
    """NFKC, case-folded, whitespace runs collapsed to one space, ends stripped."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def message_text(content: Any) -> str:
    """A message's content as one string: OpenAI text parts joined, None empty, anything else as JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def exact_key(messages: Any) -> bytes:
    """Hash of the messages exactly as sent (canonical JSON)."""
    return _digest(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS))


def prompt_key(messages: Any) -> bytes:
    """Hash of the messages' roles and normalised texts (and tool calls): the dedupe key everywhere."""
    if not isinstance(messages, list):
        return exact_key(messages)
    parts: list[Any] = []
    for m in messages:
        if not isinstance(m, dict):
            parts.append(m)
            continue
        part: list[Any] = [str(m.get("role", "")), normalise_text(message_text(m.get("content")))]
        if m.get("tool_calls"):
            part.append(m["tool_calls"])
        parts.append(part)
    return _digest(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS))


def prompt_side(messages: Any) -> Any:
    """A conversation turn's prompt side: its messages without the assistant turns (system and user turns
    in order). Only for a `turns = "all"` turn, whose assistant turns are all the target's own answers."""
    if not isinstance(messages, list):
        return messages
    return [m for m in messages if not (isinstance(m, dict) and m.get("role") == "assistant")]


def turn_key(messages: Any) -> bytes:
    """The dedupe key of a `turns = "all"` turn: `prompt_key` of its prompt side (`prompt_side`)."""
    return prompt_key(prompt_side(messages))


def is_turn(record: Mapping[str, Any]) -> bool:
    """A record (responses.jsonl line, merged sample) of one turn of a `turns = "all"` conversation."""
    turn = record.get("turn")
    return isinstance(turn, int) and not isinstance(turn, bool)


def record_key(record: Mapping[str, Any]) -> bytes:
    """A record's dedupe key: `turn_key` for a conversation turn (`is_turn`), else `prompt_key` of its messages."""
    messages = record.get("messages")
    return turn_key(messages) if is_turn(record) else prompt_key(messages)
