"""The HTTP client for any OpenAI-compatible chat API (OpenRouter first), on aiohttp + orjson.

One `ClientSession` for the life of a run; its connector is sized to the run's concurrency (the
default pool of 100 would silently cap a run at 100). Every failure becomes a `RequestFailed`
whose `kind` says whose problem it is and so how the engine treats it (core/generate/api/classify.py).

Everything upstream says besides the answer's text is redacted here, where it enters (core/secrets.py):
the X-Generation-Id header, `provider`, `model`, `id`, the finish reasons, every error's message and
metadata, a generation record. An upstream that echoes the key in any of them (plain, JSON-escaped,
percent-encoded, base64) gets it into no ledger, record, event, attach stream or panel.

An answer a provider runs past the body's answer cap (core/request_keys.py `past_cap_limits`) is not
returned: a stream is cut (closed by the client) as soon as its usage counts, or its text length, pass
the cap by the margin, and a finished answer whose usage does is refused the same way (PAST_CAP).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from draftgen.core.bodies import ChatBody
from draftgen.core.generate.api.answer import ChatAnswer, StreamState, feed_lines, parse_completion, redacted_answer
from draftgen.core.generate.api.classify import PastCap, RequestFailed, cannot_connect, classify_status
from draftgen.core.generate.api.deadlines import Deadlines
from draftgen.core.records import ErrorKind
from draftgen.core.request_keys import body_max_tokens, past_cap_limits
from draftgen.core.secrets import Redactor
from draftgen.core.servers import ServerProfile

__all__ = ["ChatClient", "RequestFailed", "classify_status"]


def get_failure(path: str, e: RequestFailed) -> str:
    """A failed `get_json(path)` said with its path once: its messages for a connection or a body it could
    not read name the request already, a status's does not."""
    return e.message if e.message.startswith(f"GET {path}") else f"GET {path}: {e.message}"


def redacted(e: RequestFailed, redact: Redactor) -> RequestFailed:
    """The failure with its message and metadata (every string in it) redacted, in place."""
    e.message = redact(e.message)
    e.args = (e.message,)
    e.metadata = redact.deep(e.metadata)
    return e


# One SSE line may carry a whole answer (a server that sends it in one event): room for a few MB. A line
# past it is an answer past max_tokens (no answer within a cap needs one so long), whatever its body's bound.
MAX_SSE_LINE = 1 << 24

# Bounded reads (docs/money.md): no body is read whole. An answer's body, streamed or not, is read
# as it arrives, decompressed (aiohttp inflates gzip, deflate, br, zstd a bounded piece at a time), and
# cut once it passes answer_body_limit of the body's answer cap: the attempt has run past max_tokens
# (PAST_CAP: not kept, booked at its worst case or its generation record, billing.py). A token takes
# far fewer bytes than BODY_BYTES_PER_TOKEN even as one SSE event of its own (OpenRouter's ~450 bytes
# with `reasoning_details` beside `reasoning`), or JSON-escaped twice over in a non-streamed body;
# BODY_BYTES_BASE holds the rest (the envelope, usage, a self-hosted server's prompt token ids: ~7 bytes
# a prompt token, 2 MB for 256k, keep-alive comments).
BODY_BYTES_PER_TOKEN = 1024
BODY_BYTES_BASE = 8 << 20
UNCAPPED_BODY_LIMIT = 64 << 20  # a body without an answer cap (draftgen always sends one)
GET_BODY_LIMIT = 16 << 20  # /key, /credits, /generation, /models, /endpoints (OpenRouter's /models: ~1 MB)
ERROR_BODY_LIMIT = 1 << 20  # an error status's body: its message and metadata, the rest dropped


def answer_body_limit(cap: int) -> int:
    """The most bytes (decompressed) an answer's body may take under answer cap `cap`."""
    return cap * BODY_BYTES_PER_TOKEN + BODY_BYTES_BASE if cap > 0 else UNCAPPED_BODY_LIMIT


async def read_upto(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """The body, read as it arrives up to `limit` bytes (decompressed): (what was read, at most `limit`
    bytes; whether more was there). The rest is left unread: the connection is closed, not drained.
    `readany` in a loop (b"" at the end), as `iter_any` does, without its iterator, a coroutine per piece
    and the StopAsyncIteration at the end: ~1 us a request of the 2.6 it cost."""
    parts: list[bytes] = []
    size = 0
    readany = resp.content.readany
    while data := await readany():
        size += len(data)
        if size > limit:
            parts.append(data[:len(data) - (size - limit)])
            return b"".join(parts), True
        parts.append(data)
    return parts[0] if len(parts) == 1 else b"".join(parts), False


def over_long(cap: int, limit: int, provider: str | None = None) -> RequestFailed:
    """An answer's body cut at `limit` bytes: past the answer cap `cap` (PAST_CAP, at its worst case), or a
    bad body when the request carried no cap."""
    if cap <= 0:
        return RequestFailed(ErrorKind.BAD_BODY, f"HTTP 200 with a body over {limit:,} bytes: cut, not kept")
    return RequestFailed.ran_past_cap(PastCap(cap, cap, False, body_bytes=limit), provider)


def origin(url: URL) -> str:
    """scheme://host:port of `url`, the port always written (http://a and http://a:80 are one origin)."""
    return f"{url.scheme}://{url.raw_host}:{url.port}" if url.raw_host else str(url)


def redirect_refused(method: str, resp: aiohttp.ClientResponse) -> RequestFailed:
    """A 3xx: never followed (aiohttp would send the prompt, and the key to the same origin, wherever it
    points). Another scheme, host or port names both origins; the same origin names the target."""
    here = resp.url
    location = resp.headers.get("Location", "")
    try:
        there = here.join(URL(location)) if location else None
    except ValueError:
        there = None
    if there is None or not there.scheme or not there.raw_host:
        where = f"an unusable Location ({location[:200]!r})" if location else "no Location"
        return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect with "
                             f"{where}: not followed",
                             status=resp.status)
    if origin(there) != origin(here):
        return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect from "
                             f"{origin(here)} to another origin, {origin(there)}: not followed (the key and the "
                             f"prompts go to api.base_url's origin only)", status=resp.status)
    return RequestFailed(ErrorKind.REDIRECT, f"{method} {here.path}: HTTP {resp.status} redirect to "
                         f"{there.path} on the same origin ({origin(here)}): not followed", status=resp.status)


class ChatClient:
    """One session, a connector sized to `concurrency`, timeouts per phase, OpenRouter headers."""

    def __init__(self, base_url: str, api_key: str, *, concurrency: int, request_timeout_s: float = 1800.0,
                 connect_timeout_s: float = 30.0, referer: str = "", title: str = "draftgen",
                 redact: Redactor | None = None, server: ServerProfile | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._server = server  # the run's profile: its kind read for an unusual finish reason, a stream's id
        self._api_key = api_key
        self._redact = redact or Redactor(api_key)  # what comes from upstream, as it enters
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        if referer:
            self._headers["HTTP-Referer"] = referer
        if title:
            self._headers["X-Title"] = title
        self._concurrency = concurrency
        # The connect timeout is aiohttp's (per new connection); the request's own is one timer for all (deadlines.py).
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._deadlines = Deadlines(request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ChatClient:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def open(self) -> None:
        if self._session is None:
            # A few spare connections for the credit checks beside the answers in flight.
            connector = aiohttp.TCPConnector(limit=self._concurrency + 8, limit_per_host=0,
                                             ttl_dns_cache=300, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers,
                # Answers of 100 KB+ arrive in one body or one SSE line: room for a few MB.
                read_bufsize=1 << 22, max_line_size=1 << 24, max_field_size=1 << 16,
                json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def chat(self, body: ChatBody, on_generation: Callable[[str], None] | None = None, *,
                   details: bool = False) -> ChatAnswer:
        """One completion. `on_generation` hears the generation id as soon as the headers carry it
        (X-Generation-Id), before the body: what prices the request if it is abandoned; a stream
        without the header, from its first chunk's `id` (OpenRouter's generation id; not on a
        self-hosted server, whose ids name no record). `details`: a
        stream's `reasoning_details` pieces are joined into the answer's (a non-streamed body's are kept
        as they come either way)."""
        assert self._session is not None, "ChatClient.open() first"
        start = time.monotonic()
        cap = body_max_tokens(body, 0)
        try:
            with self._deadlines:  # api.request_timeout_s, one timer for every request (deadlines.py)
                async with self._session.post(f"{self.base_url}/chat/completions", data=orjson.dumps(body),
                                              allow_redirects=False) as resp:
                    tell = self._header_generation(resp, on_generation)
                    obj = await self._answer_body(resp, cap, bool(body.get("stream")), details, tell)
        except RequestFailed as e:
            raise redacted(e, self._redact) from None
        except TimeoutError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):
                raise RequestFailed(ErrorKind.CONNECTION, f"cannot connect to {self.base_url}: no answer within "
                                    f"{self._timeout.sock_connect:g} s", unreachable=True) from None
            raise RequestFailed(ErrorKind.TIMEOUT,
                                f"no complete answer within {self._deadlines.timeout_s:g} s") from None
        except aiohttp.ClientPayloadError as e:
            # The connection closed before the body's end (a stream cut after its headers): an answer
            # fault, like a truncated body. It may be this prompt's (a provider that dies on it), so it
            # counts towards max_attempts, but only while other prompts are answered (classify.py): a
            # network outage that cuts every stream fails nothing.
            raise RequestFailed(ErrorKind.BAD_BODY, f"truncated body (connection cut mid-answer): {e}") from None
        except aiohttp.ClientConnectorError as e:
            # No connection, TLS handshake included: nothing was sent (so nothing is billed), and the
            # run waits for the address like any outage, saying why ("... (TLS handshake failed: ...)",
            # classify.cannot_connect). No prompt is failed for it.
            raise RequestFailed(ErrorKind.CONNECTION, cannot_connect(self.base_url, e), unreachable=True) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientOSError, ConnectionError) as e:
            raise RequestFailed(ErrorKind.CONNECTION, f"connection error: {type(e).__name__}: {e}") from None
        except aiohttp.ClientResponseError as e:
            raise RequestFailed(ErrorKind.BAD_BODY, f"bad response: {e.message}") from None
        try:
            answer = parse_completion(obj, time.monotonic() - start, self._server)
            if cap and (n := answer.usage.completion_tokens) > cap and n > past_cap_limits(cap)[0]:  # limit >= cap
                u = answer.usage
                raise RequestFailed.ran_past_cap(PastCap(cap, u.completion_tokens, True, u, answer.priced),
                                                 answer.provider)
        except RequestFailed as e:
            raise redacted(e, self._redact) from None
        return redacted_answer(answer, self._redact)

    async def _answer_body(self, resp: aiohttp.ClientResponse, cap: int, stream: bool, details: bool,
                           on_generation: Callable[[str], None] | None) -> Any:
        """The answer's body, decoded (streamed: joined into the shape of a non-streamed one), read up to its
        bound (a stream tells `on_generation` its first chunk's id); RequestFailed for a redirect, another
        status than 200, a body past its bound or not JSON."""
        if resp.status != 200:
            if 300 <= resp.status < 400:
                raise redirect_refused("POST", resp)
            raise classify_status(resp.status, (await read_upto(resp, ERROR_BODY_LIMIT))[0], resp.headers)
        if stream:
            return await self._read_sse(resp, cap, details, on_generation)
        raw, cut = await read_upto(resp, limit := answer_body_limit(cap))
        if cut:
            raise over_long(cap, limit)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestFailed(ErrorKind.BAD_BODY, f"HTTP 200 with a body that is not JSON "
                                f"({len(raw)} bytes, truncated?)") from None

    def _header_generation(self, resp: aiohttp.ClientResponse,
                           on_generation: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """Tell `on_generation` the X-Generation-Id header's id; returns it when a stream's first chunk
        should tell it instead (no header; None where the kind bills no answers: a self-hosted server's ids
        name no record)."""
        if on_generation is None:
            return None
        gen_id = resp.headers.get("X-Generation-Id")
        if gen_id:
            on_generation(self._redact.known.get(gen_id) or self._redact(gen_id))
            return None
        return None if self._server is not None and not self._server.kind.bills_answers else on_generation

    async def _read_sse(self, resp: aiohttp.ClientResponse, cap: int = 0, details: bool = False,
                        on_generation: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The answer of an SSE stream. Whatever has arrived is taken at once (`iter_any`) and split into
        lines here: aiohttp's line iterator costs a buffer round trip per line, more than the JSON
        decode of the event. Lines that are not `data:` (`: OPENROUTER PROCESSING` keep-alives, blank
        separators, `event:`/`id:` fields) are skipped; each event is decoded once (orjson skips the
        space after `data:` and a `\r` before the newline), and its deltas are joined once at the end.
        `on_generation` hears the first chunk's `id` (the headers carried no generation id)."""
        state = StreamState(cap, details)
        partial: list[bytes] = []  # a line still arriving, in pieces
        size = 0
        left = limit = answer_body_limit(cap)  # bytes the body may still take (bounded reads, above)
        async for data in resp.content.iter_any():
            left -= len(data)
            if left < 0:
                raise over_long(cap, limit, state.meta.get("provider"))
            if data.find(b"\n") < 0:
                partial.append(data)
                size += len(data)
                if size > MAX_SSE_LINE:  # no answer within its cap needs a line this long: past max_tokens
                    raise over_long(cap, MAX_SSE_LINE, state.meta.get("provider"))
                continue
            if partial:
                partial.append(data)
                data = b"".join(partial)
            lines = data.split(b"\n")
            rest = lines.pop()  # after the last newline: the start of a line still arriving
            partial, size = ([rest], len(rest)) if rest else ([], 0)
            done = feed_lines(lines, state)
            if on_generation is not None and type(gen_id := state.meta.get("id")) is str:
                on_generation(self._redact.known.get(gen_id) or self._redact(gen_id))
                on_generation = None
            if done:
                break
        else:
            if partial:  # a last line without a newline
                feed_lines([b"".join(partial)], state)
        if not state.done and state.finish_reason is None:
            raise RequestFailed(ErrorKind.BAD_BODY, "the stream ended before the answer finished")
        if not state.choices:
            # The streamed form of HTTP 200 with `choices: []`: retried, never kept as an empty answer.
            raise RequestFailed(ErrorKind.EMPTY_CHOICES, "HTTP 200 stream with no choices")
        return state.body()

    async def get_json(self, path: str, *, key: str | None = None, at_root: bool = False) -> dict[str, Any]:
        """GET `path` under base_url (e.g. "/key"), with another key when `key` is given (a management
        key for /credits); `at_root`: under the server's root instead (base_url without its "/v1", where
        vLLM's /version and SGLang's /server_info are). RequestFailed for any status but 200."""
        assert self._session is not None
        headers = {"Authorization": f"Bearer {key}"} if key else None
        base = self.base_url.removesuffix("/v1") if at_root else self.base_url
        redact = Redactor(self._api_key, key) if key else self._redact  # another key: cut out as well
        try:
            async with self._session.get(f"{base}{path}", headers=headers, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=30, sock_connect=10)) as resp:
                if 300 <= resp.status < 400:
                    raise redacted(redirect_refused("GET", resp), redact)
                raw, cut = await read_upto(resp, GET_BODY_LIMIT if resp.status == 200 else ERROR_BODY_LIMIT)
                if resp.status != 200:
                    raise redacted(classify_status(resp.status, raw, resp.headers), redact)
                if cut:
                    raise RequestFailed(ErrorKind.BAD_BODY, f"GET {path}: body over {GET_BODY_LIMIT >> 20} MB: "
                                        "not read")
        except aiohttp.ClientConnectorError as e:
            raise RequestFailed(ErrorKind.CONNECTION, f"GET {path}: {cannot_connect(self.base_url, e)}",
                                unreachable=True) from None
        except aiohttp.ClientError as e:  # connected, then the server closed the connection or cut the body
            raise RequestFailed(ErrorKind.CONNECTION, f"GET {path}: {type(e).__name__}: "
                                f"{redact(str(e)) or 'the connection closed before the answer'}") from None
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestFailed(ErrorKind.BAD_BODY, f"GET {path}: body is not JSON") from None
        return redact.deep(obj) if isinstance(obj, dict) else {}

    async def generation(self, gen_id: str) -> dict[str, Any] | None:
        """GET /generation?id=: the generation's record, or None while it is not there yet (404)."""
        try:
            data = (await self.get_json(f"/generation?id={quote(gen_id, safe='')}")).get("data")
        except RequestFailed as e:
            if e.status == 404:
                return None
            raise
        return data if isinstance(data, dict) else None
