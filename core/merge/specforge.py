"""The SpecForge training record: one train.jsonl object from one responses.jsonl line.

What SpecForge (sgl-project/SpecForge) does with train.jsonl, read from its code:
- docs/basic_usage/data_preparation.md documents `{"id": str, "conversations": [{"role", "content"}]}`
  and says several datasets merge by concatenating JSONL files;
- data/utils.py `safe_conversations_generator` loads each line with json, keeps every key of every
  message and turns list/dict values (tool_calls) into JSON strings so Arrow sees one type;
- data/parse.py `Parser._normalize_message` accepts role/content or from/value and uses
  `content or ""`; `GeneralParser.parse` takes a first `system` message from the data (else the
  template's default system prompt), drops messages before the first user turn, and cuts the
  conversation where an assistant turn follows neither user nor tool;
- `_sanitize_message` keeps only role, content and tool_calls; `ThinkingParser` (parser_type
  "thinking", e.g. the kimi-k2-thinking and qwen3-thinking templates) also keeps
  `reasoning_content` and hands it to the tokenizer's chat template, which renders it inside
  <think>...</think>. Other parsers drop it, so it must sit beside `content`, never inside it.
So every turn gets a string `content`, the answer's reasoning goes in `reasoning_content` on the
final assistant turn, and prompt turns keep their order (system first when the prompt had one).
Arrow needs one key set per batch of rows (checked with `datasets` 3.6, 4.0, 4.4 and 5.2 through
that generator: before 5.x a `tool_calls` key present in some batches and not others fails to
load), so when any kept sample has tool calls (in its prompt or its answer), every final assistant
turn carries `tool_calls`: the answer's own (reconstruction renders them into the tokens), else
`[]` (chat templates test it for truth). Other message keys (tool_call_id, name) are left out:
SpecForge's parsers drop them.
The token ids in tokens/ are the ground truth, for extraction and for online training (which reads
them as train-tokens.jsonl): SpecForge re-tokenizing train.jsonl with its own template gives other
ids (it adds a default system prompt to a row without one; Kimi-K2.5's own template drops the final
answer's reasoning), so train.jsonl is for people to read (docs/training.md).
"""

from __future__ import annotations

from typing import Any

from draftgen.core.dedupe import message_text
from draftgen.core.records import StoredResponse


def _turn(message: dict[str, Any]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": str(message.get("role", "")), "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]  # SpecForge keeps tool_calls on a turn
    return turn


def specforge_record(sample_id: str, response: StoredResponse, *, tool_calls_key: bool = False,
                     system: str | None = None) -> dict[str, Any]:
    """One train.jsonl object from a responses.jsonl record: the prompt as sent, then the answer.

    `tool_calls_key`: some sample of the merge has tool calls, so every row carries the key (see top).
    `system`: the default system turn the run rendered ([tokenizer] default_system): written out in
    front of a prompt without one, so no downstream template adds its own (SpecForge's kimi templates
    would add "You are a helpful assistant.").
    """
    messages = response.get("messages")
    conversations = [_turn(m) for m in (messages if isinstance(messages, list) else ()) if isinstance(m, dict)]
    if system is not None and not (conversations and conversations[0]["role"] == "system"):
        conversations.insert(0, {"role": "system", "content": system})
    answer: dict[str, Any] = {"role": "assistant", "content": message_text(response.get("content")),
                              "reasoning_content": message_text(response.get("reasoning"))}
    if tool_calls_key or response.get("tool_calls"):
        answer["tool_calls"] = response.get("tool_calls") or []
    conversations.append(answer)
    return {"id": sample_id, "conversations": conversations}


def has_tool_calls(record: StoredResponse) -> bool:
    """The answer or a prompt turn has tool calls."""
    messages = record.get("messages")
    return bool(record.get("tool_calls")) or (
        isinstance(messages, list) and any(isinstance(m, dict) and m.get("tool_calls") for m in messages))
