"""The shapes of a chat request as draftgen builds and reads them: its body and its messages.

A body is built in one place, `Config.request_body` (core/config.py): the model, the prompt's messages,
the dataset's max_tokens, then the `[request]` table and the dataset's own `request` as written, then
the keys the run decides (stream, the id keys, a sampling cycle's temperature and effort). The tables'
keys are the user's: which ones may appear is core/request_keys.py's (PLAIN, CAP, RESERVED, and any key
listed in `[api] request_pass_through`), so a `ChatBody` may carry keys this type does not name. They
enter there, with the one cast; everywhere downstream (Room, Request, billing, prices, the client, the
fleet, the smoke test) the body is a `ChatBody`. What weighs every key of a body, declared or not (its
answer cap and answer count: request_keys.py `body_max_tokens`, `body_answers`), reads it as a Mapping.

These are types only (TypedDict: plain dicts at run time, nothing checked or copied). What a server
sends back is not one of them until checked: core/generate/api/answer.py parses it from raw JSON.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict, cast


class ToolFunction(TypedDict):
    """The function of a tool call as an assistant message carries it: its arguments are the text the
    model generated (not re-serialised)."""
    name: str | None
    arguments: str


class ToolCall(TypedDict):
    """One tool call of an assistant message sent back in a later request (conversations.py `tool_call`):
    the target's own id, as its answer gave it (None when it gave none)."""
    id: str | None
    type: str
    function: ToolFunction


class ChatMessage(TypedDict, total=False):
    """One message of a request's `messages`: a system, user or tool message of the prompt file (its
    content always text, prompts.py), or an earlier answer of the target sent back as the assistant
    message of a later turn (conversations.py `history_message`), with its reasoning as the server's kind
    takes it back (core/server_kinds.py `history_reasoning`) and its tool calls."""
    role: Required[str]
    content: Required[str]
    name: str
    tool_call_id: str | None                 # a tool result: the id of the call it answers
    tool_calls: list[ToolCall]
    reasoning: str                           # OpenRouter: the reasoning text, without reasoning_details
    reasoning_details: list[Any]             # OpenRouter: passed back unmodified, as the answer gave them
    reasoning_content: str                   # vLLM and SGLang


class StreamOptions(TypedDict, total=False):
    include_usage: bool


class ChatBody(TypedDict, total=False):
    """A chat completions request body: the keys draftgen sets or reads. The `[request]` tables may add
    others (see the module's docstring); none of these is required of a table."""
    model: str
    messages: list[ChatMessage]
    max_tokens: int
    max_completion_tokens: int
    stream: bool
    stream_options: StreamOptions
    temperature: float
    top_p: float
    seed: int
    n: int
    best_of: int
    reasoning: dict[str, Any]                # OpenRouter: effort, max_tokens, exclude, enabled
    reasoning_effort: str                    # vLLM and SGLang
    include_reasoning: bool
    tools: list[Any]                         # an agent line's tool declarations, sent as the file gives them
    return_token_ids: bool                   # vLLM 0.10.2+, SGLang 0.5.17+ unstreamed
    return_output_ids_in_sglext: bool        # SGLang 0.5.20+ streamed
    return_input_ids_in_sglext: bool
    provider: dict[str, Any]                 # OpenRouter's provider routing, as written in the table
    models: list[str]                        # OpenRouter's fallback models (route = "fallback")
    usage: dict[str, Any]


class Sampling(TypedDict):
    """A record's `sampling` field (core/records.py): the temperature and reasoning effort of the body
    actually sent (config_tables.py `sampling_of`), None where the body had none."""
    temperature: float | None
    reasoning_effort: str | None


def any_keys(body: ChatBody) -> dict[str, Any]:
    """The same body (not a copy) read or written by a key this type does not name: a table's own cap key
    (`max_output_tokens`, `max_new_tokens`), a key chosen at run time (request_keys.py COMPLETION_LIMIT_KEYS,
    servers.py IDS_KEYS)."""
    return cast(dict[str, Any], body)


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The same messages (not a copy) as core/tokens/ reads them: plain dicts, as from a record on disk."""
    return cast(list[dict[str, Any]], messages)
