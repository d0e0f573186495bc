"""The shapes of the lines draftgen writes, documented next to the code that writes them.

`<dataset>/responses.jsonl` — one answered prompt per line:

    id                    str, the prompt id (integers in the prompt file are written as strings)
    messages              list, the messages sent (OpenAI format)
    reasoning             str | null, the model's reasoning text
    content               str, the answer text ("" when empty)
    tool_calls            list | null
    finish_reason         str | null ("stop", "length", ...)
    native_finish_reason  str | null, the provider's own
    provider              str | null, e.g. "Together"
    model                 str | null, the model that answered (an answer from another model than the one
                          asked, `same_model`, is kept here but left out by the merge)
    generation_id         str | null, OpenRouter's id (GET /generation?id=...)
    usage                 {prompt_tokens, completion_tokens, reasoning_tokens, cost}
    latency_s             float, the final attempt's wall time
    attempts              int, attempts made (1 = first try)
    truncated             bool, finish_reason == "length"
    empty_content         bool, no content (e.g. reasoning used up max_tokens)
    token_ids             list[int] | absent, completion token ids when the backend returned them
    prompt_token_ids      list[int] | absent, the prompt ids the backend ran, when it returned them
                          (vLLM, SGLang with `[api] return_token_ids`); reconstruction compares them
                          with the rendered prompt (`matches_backend_prompt`)
    ts                    float, unix time it was written
    sampling              {temperature: float | null, reasoning_effort: str | null} | absent: what the body
                          sent carried (`reasoning.effort`, or `reasoning_effort` self-hosted), written when
                          the dataset sets sampling cycles (`temperatures`, `reasoning_efforts`) or turns =
                          "all" (config_tables.sampling_of; added to the line by record_book.record_answer)
    server                str | absent, the server that answered when [api] base_url is a list (a fleet of
                          self-hosted servers, core/generate/api/fleet.py): its URL without credentials

  A dataset with `turns = "all"` (one line per turn of a conversation, docs/multi-turn.md) adds:

    conversation          str, the conversation's id in the prompt file; `id` is the turn's, "<conversation>#t<k>"
    turn                  int, k (1-based): `messages` holds the system turn, user turns 1..k and the
                          target's own stored answers to turns 1..k-1 as they were sent
    turns                 int, the conversation's user turns (after max_turns)
    prompt_hash           str, the fingerprint of the system and user turns 1..k (16 hex): a stored
                          turn whose hash the prompt file no longer has is an edit between runs
    reasoning_details     list | null, OpenRouter's structured reasoning as returned (a stream's pieces
                          joined): what the next turn passes back unmodified

  A step of an agent line (OpenAI layout with `tools` or tool calls: each assistant message one step, `turn`
  its number, docs/multi-turn.md) adds:

    tools                 list | null, the line's `tools` as the request sent them (present on every agent step)
    tool_results          "matched" | "replayed" | absent: `messages` carries the dataset's tool results spliced
                          after the target's own calls (under the target's call ids); "replayed" when one of
                          them followed calls that were not the dataset's (tool_results = "replay")
    diverged              true | absent: this answer is not the dataset's next move (other calls, a call where
                          the dataset answered, an answer where it called): the answer is a sample, the
                          conversation ends here

`<dataset>/failures.jsonl` — one prompt that failed for good per line:

    id, messages, error_kind (an ErrorKind value), status (HTTP status or null), message, attempts, ts
    (+ conversation, turn, turns, prompt_hash for a turn of a conversation, as above)

`<dataset>/rejected.jsonl` — one unusable input line per line:

    line (1-based line number in the prompt file), id (or null), reason, ts

`<dataset>/tokens/index.jsonl` metadata (beside id/offset/length, see core/tokens/store.py):

    answer_start, answer_end  token positions of the answer span [start, end) (after the <think>
                              that opens the assistant turn, through its <|im_end|>)
    valid                     bool, every validation check passed
    failed_checks             list[str], names from core/tokens/reconstruct.py CHECKS
    span_tokens               int, tokens in the answer span
    billed_tokens             int | null, usage.completion_tokens
    count_diff                int | null, span_tokens - billed_tokens
    truncated                 bool, copied from the response
    source                    "reconstructed" or "backend" (token ids the server returned)
    prompt_tokens             int | null, tokens before the answer span (the rendered prompt)
    billed_prompt_tokens      int | null, usage.prompt_tokens (the provider's count of what it ran)
    prompt_diff               int | null, prompt_tokens - billed_prompt_tokens
    provider                  str | null, copied from the response
    prompt_source             "rendered" (the chat template's prompt) or "backend" (the server's
                              prompt_token_ids, which the sample then holds); absent in older stores
    turn                      int, the record's `turn` (multi-turn datasets only; absent otherwise)
    history_spans             list[[start, end]], earlier assistant turns in the prompt, from the <think>
                              after their header through their <|im_end|> (absent when there are none,
                              or the prompt is the server's and differs from the rendering)
    tool_calls                int, the tool calls in the answer (absent when it made none): the
                              report counts answers calling tools, and `tool_call_ids` applies
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import orjson

from draftgen.core.bodies import ChatMessage, Sampling
from draftgen.core.rundir import iter_jsonl


class ErrorKind(StrEnum):
    """Why a request produced no answer (tallied in the UI, written as failures.jsonl `error_kind`)."""
    RATE_LIMITED = "429"
    SERVER = "5xx"
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    BAD_BODY = "bad_body"
    ERROR_IN_200 = "200_error"
    FINISH_ERROR = "finish_error"
    EMPTY_CHOICES = "empty_choices"
    REQUEST_TIMEOUT = "408"
    IN_FLIGHT_BUDGET = "402_in_flight"      # the in-flight spending budget is full for now
    BAD_REQUEST = "400"
    CONTEXT_LENGTH = "400_context_length"
    INVALID_PROMPT = "400_invalid_prompt"
    MAX_TOKENS_EXCEEDED = "400_max_tokens"  # max_tokens above what any allowed endpoint accepts
    UNAUTHORIZED = "401"
    FORBIDDEN = "403"
    BUDGET_LIMIT = "403_limit"              # key cap, guardrail or workspace budget reached
    PAYMENT_REQUIRED = "402"
    WEIGHT_EXCEEDS_BUDGET = "402_weight"    # one request costs more than the whole in-flight budget
    NO_ENDPOINTS = "404_no_endpoints"
    NOT_FOUND = "404"
    REDIRECT = "3xx"                        # a redirect, never followed: api.base_url is not where the server answers
    PAYLOAD_TOO_LARGE = "413"
    OTHER_4XX = "other_4xx"
    UNEXPECTED_FIELD = "4xx_unexpected_field"  # the server refuses a request key (a strict server's 422)
    MODERATED = "moderated"
    PAST_CAP = "past_cap"                   # a provider ran the answer past max_tokens: cut, not kept
    # Answers that count as done but are tallied as errors:
    LENGTH = "length"
    EMPTY_CONTENT = "empty_content"
    NO_IDS = "no_ids"  # a self-hosted server asked for its token ids answered without them
    OTHER_MODEL = "other_model"  # the answer's `model` is not the model asked (same_model): never a sample
    BAD_BILL = "bad_bill"  # its usage (cost, token counts) not believed: booked at its worst case or its record


ERROR_KINDS = tuple(k.value for k in ErrorKind)
# Tallied with the errors, but answers that were kept: not counted as errors in a status line.
KEPT_ANSWER_KINDS = frozenset({ErrorKind.LENGTH.value, ErrorKind.EMPTY_CONTENT.value, ErrorKind.NO_IDS.value,
                               ErrorKind.OTHER_MODEL.value, ErrorKind.BAD_BILL.value})

# What may follow a model id and still name the same model: a date or a version ("-0127", "-20260127",
# "-2026-01-27", "-v2", "-v1.1").
_RELEASE = re.compile(r"-(?:\d{4}|\d{6}|\d{8}|\d{4}-\d{2}(?:-\d{2})?|v\d+(?:\.\d+)*)")


def same_model(asked: str, answered: Any) -> bool:
    """Whether an answer's `model` names the model asked. OpenRouter answers with the slug asked, or that
    slug with a date or version after it (`moonshotai/kimi-k2.5-0127` for `moonshotai/kimi-k2.5`), and
    without a routing variant (`:nitro`, `:free`); a self-hosted server with the name it was started with,
    which is the config's (vLLM refuses another; SGLang echoes it). Case is not compared. One side may carry
    the date or version the other lacks; anything else (`moonshotai/kimi-k2` for `kimi-k2.5`) is another
    model. An answer naming no model (null, absent, "") is not judged: True."""
    if not isinstance(answered, str):
        return answered is None
    return _same_name(asked, answered)


@functools.lru_cache(maxsize=256)
def _same_name(asked: str, answered: str) -> bool:
    """`same_model` of two strings. Kept per pair (a run meets one or two: asked once per answer, ~0.5 us
    of string work each time otherwise); bounded, as an upstream may name a new model in every answer."""
    if not answered.strip():
        return True
    a, b = (name.strip().lower().partition(":")[0] for name in (asked, answered))
    if a == b:
        return True
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return long.startswith(short) and _RELEASE.fullmatch(long[len(short):]) is not None


def error_count(tally: Iterable[tuple[str, int]]) -> int:
    """The errors in a tally of (kind, count), leaving out the answers that were kept."""
    return sum(n for kind, n in tally if kind not in KEPT_ANSWER_KINDS)


def count_of(value: Any) -> int:
    """A token count read from a line: anything but a sane non-negative int counts as 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def cost_of(value: Any) -> float:
    """A cost in USD read from a line: anything but a finite non-negative number (booleans included)
    counts as 0, so a line edited by hand or written by another tool never inflates the spend."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and 0 <= value < 1e9 else 0.0


def reasoning_text(message: Mapping[str, Any], keys: tuple[str, ...] = ("reasoning", "reasoning_content")) -> str:
    """A message's reasoning text: the first of `keys` holding a non-empty string (an answer from
    OpenRouter says `reasoning`; vLLM, SGLang and the chat templates `reasoning_content`), else the text
    of OpenRouter's `reasoning_details` (`reasoning.text` parts' text, `reasoning.summary` parts'
    summary; encrypted parts have none); "" when it has none."""
    for key in keys:
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    details = message.get("reasoning_details")
    if not isinstance(details, list):
        return ""
    return "".join(t for d in details if isinstance(d, dict) for t in [d.get("text") or d.get("summary")]
                   if isinstance(t, str))


def _finite(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) else 0.0


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost: float = 0.0

    @classmethod
    def from_dict(cls, raw: Any) -> Usage:
        """Lenient: odd values (a hand-edited line) count as nothing, never a crash."""
        if not isinstance(raw, dict):
            return cls()
        return cls(count_of(raw.get("prompt_tokens")), count_of(raw.get("completion_tokens")),
                   count_of(raw.get("reasoning_tokens")), cost_of(raw.get("cost")))


def own_calls(tool_calls: Any) -> list[tuple[str, Any]] | None:
    """An answer's `tool_calls` as (name, arguments parsed as JSON) in order ([] when it called none), None
    when one of them names no function."""
    out = []
    for call in tool_calls or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(name := fn.get("name"), str) or not name:
            return None
        out.append((name, parsed_arguments(fn.get("arguments"))))
    return out


def parsed_arguments(raw: Any) -> Any:
    """A call's `arguments` as compared: a JSON string parsed (the text itself when it is not JSON), an
    object as it is ("" and null: an empty object). The standard library parses them: it keeps an
    integer past 64 bits exact, where orjson reads it as a float (two such integers that differ compared
    equal). A value orjson cannot write back (nested deeper than its 254 levels, an integer past 64 bits,
    a lone surrogate) is compared as the standard library writes it (keys sorted), else as its text
    (`arguments_text`), so neither `same_calls` nor a line's fingerprint fails on a hostile server's or
    a dataset's call."""
    if raw is None or raw == "":
        return {}
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw, parse_constant=_not_json, parse_float=_json_float)
        except (ValueError, RecursionError):  # NaN, Infinity and 1e400 are not JSON numbers either
            return raw
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        try:  # keys sorted, no spaces, ASCII: the same arguments give the same text
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        except (RecursionError, TypeError, ValueError):
            return arguments_text(raw)
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_float(text: str) -> float:
    """A JSON number as orjson reads it: one past a double's range is refused (orjson would write inf as null)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


def arguments_text(raw: Any) -> str:
    """A call's `arguments` as an assistant message sends them back: the text as the answer gave it
    (what the model generated, not re-serialised), an object as JSON ("" for none). An object orjson
    cannot write (nested deeper than 254 levels) is written by the standard library, and one deeper than
    that writes either (Python's recursion limit) says so: a server's answer never fails the run."""
    if isinstance(raw, str):
        return raw
    if raw is None:
        return ""
    try:
        return orjson.dumps(raw).decode()
    except orjson.JSONEncodeError:
        try:
            return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
        except (RecursionError, TypeError, ValueError):
            return "(arguments nested too deep to write)"


def same_calls(a: list[tuple[str, Any]] | None, b: list[tuple[str, Any]] | None) -> bool:
    """The same calls: the same names in order, arguments equal as JSON (keys in any order; 1 is not 1.0)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x[0] == y[0] and orjson.dumps(x[1], option=orjson.OPT_SORT_KEYS) ==
               orjson.dumps(y[1], option=orjson.OPT_SORT_KEYS) for x, y in zip(a, b, strict=True))


def broken_answer(content: str, finish_reason: str | None, tool_calls: Any, *, agent: bool = False) -> str:
    """Why an answer cannot be the history of a later turn of its conversation ("" when it can;
    core/generate/loop/conversations.py). A step of an agent line may call tools (each call with an id,
    that its result is sent under)."""
    if finish_reason == "length":
        return "cut at max_tokens"
    if finish_reason in ("content_filter", "error"):  # a partial answer: nothing is asked on it
        return f"ended by {finish_reason}"
    if tool_calls:
        if not agent:
            return "answered with tool calls"
        if own_calls(tool_calls) is None or not all(isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]
                                                    for c in tool_calls):
            return "a tool call with no name or id"
        return ""
    if not content.strip():
        return "empty answer"
    return ""


@dataclass(slots=True)
class TurnFields:
    """Which turn of which conversation a record is (the fields documented above); an agent line's step
    also what it sent (`tools`, `tool_results`) and what its answer is judged on (`expect`, not written)."""
    conversation: str
    turn: int
    turns: int
    prompt_hash: str
    agent: bool = False                        # a step of an agent line: `tools` is written (null when none)
    tools: list[Any] | None = None             # the tools the request sends
    tool_results: str | None = None            # "matched" / "replayed": the history carries spliced results
    # The dataset's calls at this step when a later step follows (None: not judged, the last step), and
    # whether its results are replayed whatever the target calls (tool_results = "replay").
    expect: list[tuple[str, Any]] | None = None
    replay: bool = False

    def add_to(self, line: TurnKeys) -> None:
        """The turn's keys added to a record's line, in the documented order."""
        line["conversation"] = self.conversation
        line["turn"] = self.turn
        line["turns"] = self.turns
        line["prompt_hash"] = self.prompt_hash
        if self.agent:
            line["tools"] = self.tools
            if self.tool_results:
                line["tool_results"] = self.tool_results

    def diverges(self, tool_calls: Any) -> bool:
        """An answer with these calls is not the dataset's next move, so nothing more is asked on it: other
        calls than the dataset's (with "replay": another number of calls), a call where the dataset answered,
        an answer where it called. False for a step not judged (the last, or not an agent line's)."""
        if self.expect is None:
            return False
        got = own_calls(tool_calls)
        if got is None:
            return True
        if self.replay:
            return len(got) != len(self.expect)
        return not same_calls(got, self.expect)

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> TurnFields | None:
        """The turn fields of a line, None when it has no sane `conversation` and `turn`."""
        conv, turn, ph = raw.get("conversation"), count_of(raw.get("turn")), raw.get("prompt_hash")
        if not isinstance(conv, str) or turn < 1:
            return None
        return cls(conv, turn, count_of(raw.get("turns")), ph if isinstance(ph, str) else "")


class UsageLine(TypedDict):
    """A responses.jsonl line's `usage`."""
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: float


class TurnKeys(TypedDict, total=False):
    """The keys a turn of a conversation adds to a record's line (`TurnFields.add_to`)."""
    conversation: str
    turn: int
    turns: int
    prompt_hash: str
    tools: list[Any] | None
    tool_results: str


class ResponseLine(TurnKeys):
    """One line of responses.jsonl as written (`ResponseRecord.line`, record_book.py `record_answer`), the
    fields documented above; the keys a line may lack are NotRequired (and TurnKeys'). A line read back is
    not one of these until checked (`StoredResponse`, `ResponseRecord.from_dict`)."""
    id: str
    messages: list[ChatMessage]
    reasoning: str | None
    content: str
    tool_calls: list[Any] | None
    finish_reason: str | None
    native_finish_reason: str | None
    provider: str | None
    model: str | None
    generation_id: str | None
    usage: UsageLine
    latency_s: float
    attempts: int
    truncated: bool
    empty_content: bool
    ts: float
    token_ids: NotRequired[list[int]]
    prompt_token_ids: NotRequired[list[int]]
    reasoning_details: NotRequired[list[Any] | None]
    sampling: NotRequired[Sampling]
    server: NotRequired[str]
    diverged: NotRequired[bool]


class FailureLine(TurnKeys):
    """One line of failures.jsonl as written (`FailureRecord.to_dict`)."""
    id: str
    messages: list[ChatMessage]
    error_kind: ErrorKind
    status: int | None
    message: str
    attempts: int
    ts: float


class StoredResponse(TypedDict, total=False):
    """A responses.jsonl line read back (`stored_responses`): a JSON object whose keys are a ResponseLine's but
    whose values are unchecked (a line edited by hand or written by another tool), so each is `object` until
    its reader narrows it (`isinstance`), or `ResponseRecord.from_dict` reads the whole line leniently."""
    id: object
    messages: object
    reasoning: object
    content: object
    tool_calls: object
    finish_reason: object
    native_finish_reason: object
    provider: object
    model: object
    generation_id: object
    usage: object
    latency_s: object
    attempts: object
    truncated: object
    empty_content: object
    ts: object
    token_ids: object
    prompt_token_ids: object
    reasoning_details: object
    sampling: object
    server: object
    diverged: object
    conversation: object
    turn: object
    turns: object
    prompt_hash: object
    tools: object
    tool_results: object


def stored_response(raw: dict[str, Any]) -> StoredResponse:
    """A responses.jsonl line parsed as a JSON object, typed as read back: its keys known, its values unchecked."""
    return cast(StoredResponse, raw)  # every value `object`: nothing is assumed of it


def stored_responses(path: Path) -> Iterator[tuple[int, StoredResponse]]:
    """(byte offset, line) for each whole line of a responses.jsonl that is a JSON object (rundir.py
    `iter_jsonl`: a torn or unparseable line is skipped), typed as read back (`stored_response`)."""
    for offset, raw in iter_jsonl(path):
        yield offset, stored_response(raw)


def answer_source(record: Mapping[str, Any]) -> str | None:
    """Whom an answer's fidelity is tallied and judged under: the fleet's server that answered (`server`),
    else the provider (`provider`); None when the line names neither."""
    for key in ("server", "provider"):
        if isinstance(value := record.get(key), str):
            return value
    return None


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class ResponseRecord:
    """One line of responses.jsonl (fields as documented above, in the order they are written)."""
    id: str
    messages: list[ChatMessage]                   # as sent (read back leniently: a list, its items unchecked)
    reasoning: str | None
    content: str
    tool_calls: list[Any] | None
    finish_reason: str | None
    native_finish_reason: str | None
    provider: str | None
    model: str | None
    generation_id: str | None
    usage: Usage
    latency_s: float
    attempts: int
    truncated: bool
    empty_content: bool
    ts: float
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    turn: TurnFields | None = None                # a turn of a conversation (turns = "all")
    reasoning_details: list[Any] | None = None    # written with `turn` only

    def to_dict(self) -> ResponseLine:
        return ResponseRecord.line(
            self.id, self.messages, self.reasoning, self.content, self.tool_calls, self.finish_reason,
            self.native_finish_reason, self.provider, self.model, self.generation_id, self.usage, self.latency_s,
            self.attempts, self.truncated, self.empty_content, self.ts, self.token_ids, self.prompt_token_ids,
            self.turn, self.reasoning_details)

    @staticmethod
    def line(id: str, messages: list[ChatMessage], reasoning: str | None, content: str, tool_calls: list[Any] | None,
             finish_reason: str | None, native_finish_reason: str | None, provider: str | None, model: str | None,
             generation_id: str | None, u: Usage, latency_s: float, attempts: int, truncated: bool,
             empty_content: bool, ts: float, token_ids: list[int] | None, prompt_token_ids: list[int] | None,
             turn: TurnFields | None, reasoning_details: list[Any] | None) -> ResponseLine:
        """The line of these fields, in the class's order: what the run writes for each answer, built
        straight from the answer (no record object in between: this runs once per request)."""
        line: ResponseLine = {
            "id": id, "messages": messages, "reasoning": reasoning, "content": content,
            "tool_calls": tool_calls, "finish_reason": finish_reason,
            "native_finish_reason": native_finish_reason, "provider": provider, "model": model,
            "generation_id": generation_id,
            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                      "reasoning_tokens": u.reasoning_tokens, "cost": u.cost},
            "latency_s": latency_s, "attempts": attempts, "truncated": truncated,
            "empty_content": empty_content, "ts": ts}
        if token_ids is not None:
            line["token_ids"] = token_ids
        if prompt_token_ids is not None:
            line["prompt_token_ids"] = prompt_token_ids
        if turn is not None:
            turn.add_to(line)
            line["reasoning_details"] = reasoning_details
        return line

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> ResponseRecord:
        """Read a line leniently (resume, merge): a line edited by hand or written by another tool
        gets neutral values for what is odd, not a crash; `id` is always a string."""
        def text(key: str) -> str | None:
            value = raw.get(key)
            return value if isinstance(value, str) else None

        messages, tool_calls, token_ids = raw.get("messages"), raw.get("tool_calls"), raw.get("token_ids")
        latency, attempts, ts = raw.get("latency_s"), raw.get("attempts"), raw.get("ts")
        prompt_ids = raw.get("prompt_token_ids")
        return cls(
            id=str(raw.get("id")), messages=messages if isinstance(messages, list) else [],
            reasoning=text("reasoning"), content=text("content") or "",
            tool_calls=tool_calls if isinstance(tool_calls, list) else None,
            finish_reason=text("finish_reason"), native_finish_reason=text("native_finish_reason"),
            provider=text("provider"), model=text("model"), generation_id=text("generation_id"),
            usage=Usage.from_dict(raw.get("usage")),
            latency_s=_finite(latency), attempts=count_of(attempts),
            truncated=bool(raw.get("truncated")), empty_content=bool(raw.get("empty_content")), ts=_finite(ts),
            token_ids=token_ids if isinstance(token_ids, list) else None,
            prompt_token_ids=prompt_ids if isinstance(prompt_ids, list) else None,
            turn=TurnFields.from_dict(raw),
            reasoning_details=details if isinstance(details := raw.get("reasoning_details"), list) else None)

    @property
    def short(self) -> bool:
        """Counted as truncated: cut by max_tokens or no content."""
        return self.truncated or self.empty_content


@dataclass(slots=True)  # one per request: a frozen __init__ costs 3x (setattr per field)
class FailureRecord:
    """One line of failures.jsonl."""
    id: str
    messages: list[ChatMessage]
    error_kind: ErrorKind
    status: int | None
    message: str
    attempts: int
    ts: float
    turn: TurnFields | None = None  # a turn of a conversation (turns = "all")

    def to_dict(self) -> FailureLine:
        line: FailureLine = {"id": self.id, "messages": self.messages, "error_kind": self.error_kind,
                             "status": self.status, "message": self.message, "attempts": self.attempts, "ts": self.ts}
        if self.turn is not None:
            self.turn.add_to(line)
        return line
