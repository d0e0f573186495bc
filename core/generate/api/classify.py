"""Whose problem a response is, as OpenRouter documents its responses (docs/openrouter.md, "What each
OpenRouter response does").

Every response that is not an answer becomes a `RequestFailed` whose `kind` (an ErrorKind) maps to
one `Whose`:

- PROMPT: the prompt's own (400 context length or invalid prompt, 403 moderation, 413): that prompt
  fails, with the reason. A 4xx naming no known cause (`UNRECOGNIZED_4XX`) may be the dataset's
  parameters as well: it fails the prompt only once a request sent after it is answered.
- TRANSIENT: retried with backoff and full jitter, honouring Retry-After, never pausing. The
  outage kinds (connection, 408, 429, 5xx, the in-flight-budget 402) spend no attempt: an outage
  of any length fails no prompt. The answer kinds (a timeout, a truncated body, a 200 carrying an
  error) spend an attempt only while the service, since this prompt was first sent, has given the
  other prompts more answers than answer faults (core/generate/loop/request.py).
- DATASET: the dataset's routing or settings (404 no endpoints or unknown model, 400
  max_tokens_exceeded, 402 weight_exceeds_budget, a redirect: api.base_url is not where the server
  answers, client.py): the dataset stops with the message; its prompts stay eligible.
- ACCOUNT: the key or the account (401, 402 out of credits, 403 key cap, guardrail or workspace
  budget): admission stops run-wide, nothing is failed, requests in flight finish.

The match is on the status and `error.metadata` (`limit_source`, `code`, `reasons`); the message
text is only a hint, since messages change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import orjson

from draftgen.core.records import ErrorKind, Usage


class Whose(StrEnum):
    PROMPT = "prompt"
    TRANSIENT = "transient"
    DATASET = "dataset"
    ACCOUNT = "account"


class AccountCondition(StrEnum):
    """Why the account stops admission run-wide (`limit_source` values where OpenRouter sends one)."""
    KEY_REFUSED = "key_refused"                        # 401: missing, invalid or revoked key
    OUT_OF_CREDITS = "out_of_credits"                  # 402 without an in-flight limit_source
    KEY_LIMIT = "openrouter_key_limit"                 # the key's own cap
    GUARDRAIL_BUDGET = "openrouter_guardrail_budget"
    WORKSPACE_BUDGET = "openrouter_workspace_budget"
    FORBIDDEN = "forbidden"                            # another 403 (permissions, a guardrail block)
    CREDIT_FLOOR = "credit_floor"                      # the live balance reached credit_floor_usd (no response)


BUDGET_SOURCES = frozenset({AccountCondition.KEY_LIMIT, AccountCondition.GUARDRAIL_BUDGET,
                            AccountCondition.WORKSPACE_BUDGET})
IN_FLIGHT_SOURCE = "openrouter_in_flight_budget"

WHOSE: dict[ErrorKind, Whose] = {
    ErrorKind.RATE_LIMITED: Whose.TRANSIENT,
    ErrorKind.SERVER: Whose.TRANSIENT,
    ErrorKind.TIMEOUT: Whose.TRANSIENT,
    ErrorKind.CONNECTION: Whose.TRANSIENT,
    ErrorKind.BAD_BODY: Whose.TRANSIENT,
    ErrorKind.ERROR_IN_200: Whose.TRANSIENT,
    ErrorKind.FINISH_ERROR: Whose.TRANSIENT,
    ErrorKind.EMPTY_CHOICES: Whose.TRANSIENT,
    ErrorKind.REQUEST_TIMEOUT: Whose.TRANSIENT,
    ErrorKind.IN_FLIGHT_BUDGET: Whose.TRANSIENT,
    ErrorKind.PAST_CAP: Whose.TRANSIENT,
    ErrorKind.BAD_REQUEST: Whose.PROMPT,
    ErrorKind.CONTEXT_LENGTH: Whose.PROMPT,
    ErrorKind.INVALID_PROMPT: Whose.PROMPT,
    ErrorKind.MODERATED: Whose.PROMPT,
    ErrorKind.PAYLOAD_TOO_LARGE: Whose.PROMPT,
    ErrorKind.OTHER_4XX: Whose.PROMPT,
    ErrorKind.MAX_TOKENS_EXCEEDED: Whose.DATASET,
    ErrorKind.WEIGHT_EXCEEDS_BUDGET: Whose.DATASET,
    ErrorKind.NO_ENDPOINTS: Whose.DATASET,
    ErrorKind.NOT_FOUND: Whose.DATASET,
    ErrorKind.REDIRECT: Whose.DATASET,
    ErrorKind.UNEXPECTED_FIELD: Whose.DATASET,
    ErrorKind.UNAUTHORIZED: Whose.ACCOUNT,
    ErrorKind.PAYMENT_REQUIRED: Whose.ACCOUNT,
    ErrorKind.BUDGET_LIMIT: Whose.ACCOUNT,
    ErrorKind.FORBIDDEN: Whose.ACCOUNT,
}

# Transient kinds that may still be this prompt's doing (its answer always too long for the timeout,
# always cut off, always an error from the provider): they spend an attempt while the service gives
# the other prompts more answers than answer faults since this one was first sent. Every other
# transient kind is the service's.
ANSWER_KINDS = frozenset({ErrorKind.TIMEOUT, ErrorKind.BAD_BODY, ErrorKind.ERROR_IN_200,
                          ErrorKind.FINISH_ERROR, ErrorKind.EMPTY_CHOICES, ErrorKind.PAST_CAP})
# A 4xx that names no cause OpenRouter documents (a provider's own validation message passed on): as
# likely this prompt's content as a request parameter every prompt of the dataset carries. Set aside
# unrecorded until a request sent after it is answered (then it was the prompt's: it fails) or several
# in a row say it is the dataset's (doubts.py).
UNRECOGNIZED_4XX = frozenset({ErrorKind.BAD_REQUEST, ErrorKind.OTHER_4XX})
# Kinds that cut the adaptive concurrency (AIMD) like a 429.
SLOW_DOWN_KINDS = frozenset({ErrorKind.RATE_LIMITED, ErrorKind.IN_FLIGHT_BUDGET})
# Errors that come inside an HTTP 200: their `error.code` says which status they stand for.
IN_200_KINDS = frozenset({ErrorKind.ERROR_IN_200, ErrorKind.FINISH_ERROR})


@dataclass(frozen=True)
class ErrorBody:
    """The parts of OpenRouter's `{"error": {"code", "message", "metadata"}}` that decide the class."""
    message: str = ""
    code: str = ""                 # error.code when a string, else metadata.code ("context_length_exceeded")
    metadata: dict[str, Any] | None = None

    @property
    def limit_source(self) -> str:
        meta = self.metadata or {}
        value = meta.get("limit_source")
        return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class PastCap:
    """An answer a provider ran past the body's answer cap."""
    cap: int                 # the body's answer cap (max_tokens)
    tokens: int              # completion tokens: counted (usage) or estimated from the text streamed
    counted: bool
    usage: Usage | None = None   # the answer's usage, when it came
    priced: bool = False         # usage.cost was in it
    body_bytes: int = 0          # the client cut the body at this many bytes (client.py answer_body_limit)


class RequestFailed(Exception):
    """A request that did not produce an answer, why (`kind`), and whose problem it is (`whose`)."""

    def __init__(self, kind: ErrorKind, message: str, *, status: int | None = None, retry_after: float | None = None,
                 unreachable: bool = False, account: AccountCondition | None = None,
                 metadata: dict[str, Any] | None = None, code: Any = None):
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.message = message
        self.retry_after = retry_after
        # No connection could be made at all (refused, no route, DNS, connect timeout): nothing was
        # sent, the API is down or out of reach, which says nothing about this prompt.
        self.unreachable = unreachable
        self.account = account          # for Whose.ACCOUNT: which condition
        self.metadata = metadata or {}  # error.metadata as sent (limit_usd, spend_usd, resets_at, ...)
        # An error inside a 200 (a body's `error`, a stream's error chunk) carries the status it stands
        # for in `error.code` (OpenRouter: "the same status code as error.code"): 503, 429, ...
        self.code = code if isinstance(code, int) and not isinstance(code, bool) else (
            int(code) if isinstance(code, str) and code.isdigit() else None)
        self.past_cap: PastCap | None = None  # kind PAST_CAP: what the provider produced past the cap
        self.server = ""  # the fleet's server that failed it (api/fleet.py), its URL without credentials
        # A slow-down that the fleet's server's own limit took (api/fleet.py): the dataset's limit is not cut.
        self.fleet_limited = False

    @classmethod
    def ran_past_cap(cls, cap: PastCap, provider: str | None) -> RequestFailed:
        """A provider ran the answer past the body's answer cap (client.py cut the stream, or the usage
        said so): not kept, booked at what it billed (billing.py), retried like an answer fault."""
        how = (f"its body ran past {cap.body_bytes:,} bytes, the most max_tokens allows, when the client cut it"
               if cap.body_bytes else f"{cap.tokens:,} completion tokens billed" if cap.counted else
               f"~{cap.tokens:,} completion tokens streamed (text length) when the client cut the stream")
        e = cls(ErrorKind.PAST_CAP, f"provider {provider or '(unnamed)'} ran past max_tokens {cap.cap:,}: {how}; "
                "the answer is not kept", metadata={"provider_name": provider} if provider else None)
        e.past_cap = cap
        return e

    @property
    def whose(self) -> Whose:
        return WHOSE.get(self.kind, Whose.PROMPT)

    @property
    def outage(self) -> bool:
        """An error inside a 200 coded 503 (no provider meets the routing: all down or full) or 429 (a
        rate limit met mid-stream): the service's, whatever the prompt, so it spends no attempt. Other
        codes (500, 502, 408...) stay answer faults: a provider that dies on this very prompt fails it
        after max_attempts, while the others are answered (a billed stream is not retried forever)."""
        return self.kind in IN_200_KINDS and self.code in (429, 503)

    @property
    def slow_down(self) -> bool:
        """A 429 or a full in-flight budget, or a rate limit met mid-stream (an error chunk coded 429)."""
        return self.kind in SLOW_DOWN_KINDS or (self.kind in IN_200_KINDS and self.code == 429)

    def slows_down(self, full_at_503: bool) -> bool:
        """`slow_down`, and a 503 too where the server kind answers a full queue with it (`full_at_503`:
        vLLM and SGLang; OpenRouter's 503 is its routing finding no provider: the concurrency stays)."""
        return self.slow_down or (full_at_503 and self.status == 503)

    @property
    def provider(self) -> str:
        """The provider that failed, as OpenRouter names it (`error.metadata.provider_name`); "" when the
        error is OpenRouter's own (a 503 of routing, its rate limit) or the server names none."""
        name = self.metadata.get("provider_name")
        return name if isinstance(name, str) else ""


def parse_error_body(body: bytes) -> ErrorBody:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ErrorBody(body[:300].decode("utf-8", "replace"))
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        msg = str(err.get("message") or err)
        meta = err.get("metadata") if isinstance(err.get("metadata"), dict) else None
        raw_code = err.get("code")
        code = raw_code if isinstance(raw_code, str) else ""
        if not code and meta is not None and isinstance(meta.get("code"), str):
            code = meta["code"]
        if meta is not None and meta.get("raw"):
            msg += f" ({str(meta['raw'])[:200]})"
        return ErrorBody(msg[:500], code, meta)
    if err:
        return ErrorBody(str(err)[:500])
    return ErrorBody(body[:300].decode("utf-8", "replace"))


def retry_after_of(headers: Any) -> float | None:
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from these APIs; fall back to our own backoff


def _hinted(err: ErrorBody, *words: str) -> bool:
    text = f"{err.code} {err.message}".lower()
    return any(w in text for w in words)


# How strict servers say a request key is not theirs: transformers serve's "Unexpected fields in the
# request: {...}", OpenAI's "Unrecognized request argument", Pydantic's extra_forbidden where a server
# forbids extras. vLLM and SGLang take unknown keys: vLLM logs them as ignored, SGLang drops them.
_EXTRA_WORDS = ("extra_forbidden", "extra inputs are not permitted", "unrecognized request argument",
                "unexpected keyword", "unexpected field")
_LOC = re.compile(r"""['"]loc['"]\s*:\s*[\[(]\s*['"]body['"]\s*,\s*['"]([A-Za-z_][\w.-]*)['"]""")
_QUOTED = re.compile(r"""['"`]([A-Za-z_][\w.-]*)['"`]""")
_AFTER_COLON = re.compile(r":\s*([A-Za-z_][\w.-]*)")


# SGLang 0.5.17+ refuses some keys on a stream only: "return_token_ids is not supported with streaming".
_NOT_ON_STREAMS = re.compile(r"\b([A-Za-z_]\w*) is not supported with streaming")


def unexpected_fields(status: int, body: bytes) -> list[str]:
    """The request keys a 400/422 says the server does not take, else []."""
    if status not in (400, 422):
        return []
    text = body[:20000].decode("utf-8", "replace")
    if streamed := _NOT_ON_STREAMS.findall(text):
        return sorted(set(streamed))
    lower = text.lower()
    at = min((i for i in (lower.find(w) for w in _EXTRA_WORDS) if i >= 0), default=-1)
    if at < 0:
        return []
    fields: list[str] = []
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    detail = obj.get("detail") if isinstance(obj, dict) else None
    for item in detail if isinstance(detail, list) else []:  # FastAPI's own 422 body
        loc = item.get("loc") if isinstance(item, dict) else None
        if isinstance(loc, list) and len(loc) >= 2 and loc[0] == "body" and isinstance(loc[1], str):
            fields.append(loc[1])
    # Else the names inside the message: Pydantic's error list quoted (vLLM), a set after the words.
    fields = fields or _LOC.findall(text) or _QUOTED.findall(text[at:at + 600]) \
        or _AFTER_COLON.findall(text[at:at + 200])[:1]
    skip = {"body", "type", "loc", "msg", "input", "detail", "message", "messages", "model", "extra_forbidden"}
    return sorted(dict.fromkeys(f for f in fields if f not in skip))


def config_key_for(field: str) -> str:
    """What to change in the config so that a request no longer carries `field`."""
    if field == "return_token_ids":
        return "set [api] return_token_ids = false"
    if field in ("stream", "stream_options"):
        return "set [api] stream = false"
    return f"remove [request] {field} (or the dataset's request.{field})"


def classify_status(status: int, body: bytes, headers: Any) -> RequestFailed:
    """The RequestFailed for a non-200 response (chat completions, /key, /credits)."""
    extra = unexpected_fields(status, body)
    if extra:  # a strict server refusing a key every request of the dataset carries
        where = "; ".join(f"{f}: {config_key_for(f)}" for f in extra)
        return RequestFailed(ErrorKind.UNEXPECTED_FIELD, f"HTTP {status}: the server does not accept the request "
                             f"field(s) {', '.join(extra)} ({where})", status=status,
                             metadata={"unexpected_fields": extra})
    err = parse_error_body(body)
    wait = retry_after_of(headers)
    kind, text, account = _status_class(status, err)
    return RequestFailed(kind, text, status=status, retry_after=wait, account=account, metadata=err.metadata)


# What a status and its error body come to: the kind, the message, and for Whose.ACCOUNT the condition.
_Class = tuple[ErrorKind, str, AccountCondition | None]


def _status_class(status: int, err: ErrorBody) -> _Class:
    """docs/openrouter.md's table: the budget `limit_source` first (it decides whatever the status), then
    the status, with the body's hints (`_hinted`) where one status has several causes."""
    msg = err.message
    source = err.limit_source
    if source == IN_FLIGHT_SOURCE or (status == 402 and _hinted(err, "in_flight_budget_exhausted")):
        return ErrorKind.IN_FLIGHT_BUDGET, f"HTTP {status} in-flight spending budget full: {msg}", None
    if source in BUDGET_SOURCES:  # documented as 403; some pages say 402: the source decides
        return ErrorKind.BUDGET_LIMIT, f"HTTP {status}: {msg}", AccountCondition(source)
    if status == 429:
        return ErrorKind.RATE_LIMITED, msg or "rate limited", None
    if status == 408:
        return ErrorKind.REQUEST_TIMEOUT, msg or "request timeout", None
    if status >= 500:
        return ErrorKind.SERVER, f"HTTP {status}: {msg}", None
    if status == 401:
        return ErrorKind.UNAUTHORIZED, f"HTTP 401: {msg}", AccountCondition.KEY_REFUSED
    if status == 402:
        return _payment_required(err)
    if status == 403:
        return _forbidden(err)
    if status == 404:
        # Every 404 from chat completions is routing or the model id: the dataset's, never the prompt's.
        kind = ErrorKind.NO_ENDPOINTS if _hinted(err, "endpoint", "provider") else ErrorKind.NOT_FOUND
        return kind, f"HTTP 404: {msg}", None
    if status == 400:
        return _bad_request(err)
    if status == 413:
        return ErrorKind.PAYLOAD_TOO_LARGE, f"HTTP 413: {msg or 'payload too large'}", None
    return ErrorKind.OTHER_4XX, f"HTTP {status}: {msg}", None


def _payment_required(err: ErrorBody) -> _Class:
    """A 402 (not the in-flight budget): a request weighing more than the budget is the dataset's, else
    the account is out of credits."""
    if _hinted(err, "weight_exceeds_budget"):
        return ErrorKind.WEIGHT_EXCEEDS_BUDGET, f"HTTP 402: {err.message}", None
    return ErrorKind.PAYMENT_REQUIRED, f"HTTP 402: {err.message or 'out of credits'}", AccountCondition.OUT_OF_CREDITS


def _forbidden(err: ErrorBody) -> _Class:
    """A 403 (no budget `limit_source`): moderation is the prompt's; a key limit or any other refusal the
    account's."""
    meta = err.metadata
    if meta is not None and ("reasons" in meta or "flagged_input" in meta) or _hinted(err, "moderat", "flagged"):
        return ErrorKind.MODERATED, f"HTTP 403 moderation: {err.message}", None
    if _hinted(err, "limit exceeded", "budget"):
        return ErrorKind.BUDGET_LIMIT, f"HTTP 403: {err.message}", AccountCondition.KEY_LIMIT
    return ErrorKind.FORBIDDEN, f"HTTP 403: {err.message}", AccountCondition.FORBIDDEN


def _bad_request(err: ErrorBody) -> _Class:
    """A 400: the dataset's answer cap over the model's, the prompt's length or content, else unrecognized."""
    if _hinted(err, "max_tokens_exceeded"):
        return ErrorKind.MAX_TOKENS_EXCEEDED, f"HTTP 400: {err.message}", None
    if _hinted(err, "context_length_exceeded", "context length"):
        return ErrorKind.CONTEXT_LENGTH, f"HTTP 400: {err.message}", None
    if _hinted(err, "invalid_prompt"):
        return ErrorKind.INVALID_PROMPT, f"HTTP 400: {err.message}", None
    return ErrorKind.BAD_REQUEST, f"HTTP 400: {err.message}", None


def cannot_connect(base_url: str, e: BaseException) -> str:
    """"cannot connect to 127.0.0.1:18799 (connection refused)": the address and the cause."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    os_error = getattr(e, "os_error", None)
    cause = getattr(os_error, "strerror", None) or str(os_error or e) or type(e).__name__
    if "Connect call failed" in cause or "refused" in cause.lower():
        cause = "connection refused"
    elif "SSL" in type(e).__name__ or "ssl" in cause.lower():
        return f"cannot connect to {parts.hostname}:{port} (TLS handshake failed: {cause})"
    return f"cannot connect to {parts.hostname}:{port} ({cause.lower() if cause[:1].isupper() else cause})"


# Hosts whose name is not the user's to mistype: a failure to reach them is the network's.
WELL_KNOWN_HOSTS = ("openrouter.ai",)
_DNS = ("name or service not known", "nodename nor servname", "name resolution", "no address associated",
        "getaddrinfo", "name does not resolve")
_NETWORK = ("no answer within", "timed out", "timeout", "network is unreachable", "no route to host",
            "did not answer")


def unreachable_advice(base_url: str, cause: str, config_path: object = None) -> str:
    """What to do about an address that does not answer, matched to `cause` (cannot_connect's text):
    the network for a name that does not resolve or a connection that times out, the config and the
    server for a refused port or a TLS mismatch. Read in the TUI, the headless log and at the shell:
    it names no key."""
    low = cause.lower()
    host = (urlsplit(base_url).hostname or "").lower()
    known = any(host == h or host.endswith("." + h) for h in WELL_KNOWN_HOSTS)
    where = f"[api] base_url ({base_url})" + (f" in {config_path}" if config_path else "")
    if "tls handshake" in low:
        return f"check {where}: https:// for a TLS server, http:// for a plain one"
    if "refused" in low:
        return f"check {where} and that the server is up"
    if any(k in low for k in _DNS):
        return ("check this machine's network and DNS: the host name does not resolve" if known else
                f"check this machine's network and DNS, and the host name in {where}")
    if any(k in low for k in _NETWORK) or known:
        return "check this machine's network (a proxy or a firewall?)" + ("" if known else f", and {where}")
    return f"check {where}, and this machine's network"
