"""What kind of server answers at [api] base_url, as one interface: the rest of the code asks the run's
kind what it means (`config.api.server.kind.has_account`), never which kind it is.

A kind is a subclass of `ServerKind` plus its entry in `KINDS` (the `[api] kind` value it is set by, also
named in `KindName`). Two kinds today:

    OpenRouter          an account behind the key (GET /key, /credits), answers that carry their cost
                        and a generation record to look up, routing across providers with their own
                        tokenizers, OpenRouter-only request keys (`provider`, `reasoning`, `models`...).
    OpenAICompatible    a self-hosted vLLM, SGLang or transformers serve: none of those; its release's
                        differences (which keys ask for token ids) are core/servers.py `Server`'s.

The run's kind is decided once, at its start: the `[api] kind` set, else OpenRouter on openrouter.ai, else
what GET /key answered (core/generate/api/preflight.py `note_key_answer`), and held by the run's
`ServerProfile` (core/servers.py, carried by `ApiConfig.server`). Until the server answered, a server of
kind "auto" is taken for OpenRouter: its checks are the stricter ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from draftgen.core.bodies import ChatMessage
from draftgen.core.request_keys import OPENROUTER_ONLY_KEYS

# The values of `[api] kind` (config.py reads its key's type here): "auto" and every registry entry's name.
KindName = Literal["auto", "openrouter", "openai-compatible"]


class ServerKind:
    """What one kind of server does that the run depends on. Class attributes and methods only: a kind has
    no state (what was found of one server is its `ServerProfile`'s)."""

    name: ClassVar[str]
    label: ClassVar[str]             # how messages name it ("the openai-compatible server at <url>")
    # An account behind the key: GET /key (its limit and usage) and GET /credits answer. Without one, no
    # balance is watched, no key is checked, the key's usage prices nothing.
    has_account: ClassVar[bool]
    # Answers carry their cost (`usage.cost`) and a generation id whose record (GET /generation) prices
    # an attempt that got no answer; without it, tokens are priced at [api] prices and an attempt
    # without an answer bills nothing.
    bills_answers: ClassVar[bool]
    # The endpoints listing (GET /models/{id}/endpoints) prices the model and each fallback model
    # (`models`); a $0 listing of a model that is not free is then not believed.
    lists_prices: ClassVar[bool]
    # A 503 is a full queue (slow down as at a 429), not a routing that found no provider.
    full_at_503: ClassVar[bool]
    # A finish reason other than the four that end an answer fails the attempt (no provider's own word
    # passed through on a billed answer).
    odd_finish_fails: ClassVar[bool]
    # Special-token text typed in a prompt is read as the token (tokenizer.prompt_special_tokens "auto").
    specials_as_tokens: ClassVar[bool]
    # The server gives back the token ids it generated when asked, each release its own way
    # (core/servers.py): the release is asked at start, its keys go in the body, a missing list is counted.
    returns_ids: ClassVar[bool]
    # Every answer comes from one server's tokenizer: a finished answer whose token count differs from
    # its text's is wrong (no provider's other tokenizer to excuse it).
    one_tokenizer: ClassVar[bool]
    # Streams unless [api] stream says (on openrouter.ai: aborting a stream stops its billing).
    streams_by_default: ClassVar[bool]
    # The smoke test compares streamed and non-streamed answers and decides the mode (a parser may
    # rewrite one of them).
    smoke_decides_stream: ClassVar[bool]
    # A stream carries usage only when `stream_options.include_usage` asks for it.
    stream_usage_asked: ClassVar[bool]
    # Request keys this kind does not take: left out of its bodies, with one warning (config.py).
    dropped_keys: ClassVar[tuple[str, ...]] = ()

    def put_effort(self, body: dict[str, Any], effort: str) -> None:
        """A sampling cycle's reasoning effort into `body`, as this kind reads it."""
        raise NotImplementedError

    def history_reasoning(self, msg: ChatMessage, reasoning: str | None, details: list[Any] | None) -> None:
        """An earlier answer's reasoning into its assistant message of a later request, as the API documents it."""
        raise NotImplementedError


class OpenRouter(ServerKind):
    name = "openrouter"
    label = "OpenRouter"
    # The key's account, each answer's cost and generation record, the endpoints listing's prices.
    has_account = bills_answers = lists_prices = True
    # Streamed on openrouter.ai (an aborted stream stops its billing), usage in every stream.
    streams_by_default, smoke_decides_stream, stream_usage_asked = True, False, False
    # Providers with their own stacks: no ids given, special text kept text, a count may differ by provider.
    returns_ids = specials_as_tokens = one_tokenizer = False
    # A 503 is its routing finding no provider; a provider's own finish reason comes on a billed answer.
    full_at_503 = odd_finish_fails = False

    def put_effort(self, body: dict[str, Any], effort: str) -> None:
        """`reasoning.effort`, beside the table's other reasoning keys."""
        reasoning = body.get("reasoning")
        body["reasoning"] = {**(reasoning if isinstance(reasoning, dict) else {}), "effort": effort}

    def history_reasoning(self, msg: ChatMessage, reasoning: str | None, details: list[Any] | None) -> None:
        """Its `reasoning_details` passed back unmodified, else the `reasoning` text when it had one."""
        if details:
            msg["reasoning_details"] = details
        elif reasoning:
            msg["reasoning"] = reasoning


class OpenAICompatible(ServerKind):
    name = "openai-compatible"
    label = "the openai-compatible server"
    dropped_keys = OPENROUTER_ONLY_KEYS  # a strict server answers them with a 422
    # No account and no bill: tokens priced at [api] prices, no listing.
    has_account = bills_answers = lists_prices = False
    # Streamed only where its smoke test found the parser rewrites non-streamed text; usage asked for.
    streams_by_default, smoke_decides_stream, stream_usage_asked = False, True, True
    # One server, one tokenizer: its ids asked for, special text read as the token, a count must match.
    returns_ids = specials_as_tokens = one_tokenizer = True
    # A 503 is its full queue (slow down); any finish reason but the four ends no answer.
    full_at_503 = odd_finish_fails = True

    def put_effort(self, body: dict[str, Any], effort: str) -> None:
        """The top-level `reasoning_effort` vLLM and SGLang read (`reasoning` is OpenRouter's)."""
        body["reasoning_effort"] = effort

    def history_reasoning(self, msg: ChatMessage, reasoning: str | None, details: list[Any] | None) -> None:
        """`reasoning_content`, as vLLM and SGLang take it."""
        if reasoning:
            msg["reasoning_content"] = reasoning


# The registry: `[api] kind` value -> its class (read-only: a run never adds one).
KINDS: Mapping[str, type[ServerKind]] = MappingProxyType({k.name: k for k in (OpenRouter, OpenAICompatible)})


def kind_named(name: str) -> ServerKind:
    """The kind an `[api] kind` value names (not "auto")."""
    return KINDS[name]()


def configured_kind(name: str, base_url: str) -> ServerKind | None:
    """The kind a config decides on its own: the one set, else OpenRouter's on openrouter.ai; None for "auto"
    elsewhere (the server's answer to GET /key decides)."""
    if name != "auto":
        return kind_named(name)
    return OpenRouter() if "openrouter.ai" in base_url else None


def answered_kind(has_key_endpoint: bool) -> ServerKind:
    """The kind of an "auto" server by its answer to GET /key: OpenRouter's endpoint, or none (404, 405)."""
    return OpenRouter() if has_key_endpoint else OpenAICompatible()
