"""A fleet of self-hosted servers behind one run: `[api] base_url` given as a list of URLs.

`FleetClient` is a `ChatClient` whose `chat` asks one of its servers (`Member`), each with its own
connection pool and its own count of requests in flight: a request goes to the live server with the
fewest in flight (ties: the first listed). A server is taken out of the fleet when

- it refuses a connection (nothing was sent: the request is asked of the next live server at once,
  under the same attempt, so nothing is paid or counted twice), or
- FAILS_OUT of its requests in a row end in a fault of the server's (a connection cut mid-answer, a
  body that cannot be read, a timeout, a 5xx other than the 503 of a full queue) with no answer between:
  each of those requests is booked as the attempt it was and asked again by the engine (request.py),
  on a live server, like any transient error.

Taking a server out and its coming back are said once each (`say`: the run's events.log and panel).
While a server is out it is asked `GET /models` every `probe_s` seconds; it is back at its first 200.
With every server out, requests still go to them (the least in flight first): the run then sees the
outage exactly as with one base_url (unreachable: retried until a server answers, no prompt failed).

Each answer carries its server's name (`ChatAnswer.server`, the URL without credentials), and so does
each failure (`RequestFailed.server`): the records, the per-upstream tallies of the snapshot (the providers
panel, /metrics) and the summary say which server answered. `get_json` (the run-start questions: GET /key,
/version, /server_info) and `generation` ask the first server, as with one base_url; the smoke test asks
each server on its own (commands/smoke.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from draftgen.core.generate.api.client import ChatAnswer, ChatClient, RequestFailed
from draftgen.core.records import ErrorKind
from draftgen.core.secrets import Redactor

FAILS_OUT = 5        # a server's faults in a row (no answer between) that take it out of the fleet
PROBE_S = 5.0        # how often a server taken out is asked GET /models
_SERVER_FAULTS = frozenset({ErrorKind.CONNECTION, ErrorKind.BAD_BODY, ErrorKind.TIMEOUT})


def server_name(url: str) -> str:
    """The URL as records and panels name the server: without user, password, query or fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class Member:
    """One server of the fleet: its client, what it has in flight, whether it is in the fleet."""

    __slots__ = ("url", "name", "client", "in_flight", "fails", "out", "why")

    def __init__(self, url: str, client: ChatClient) -> None:
        self.url = url
        self.name = server_name(url)
        self.client = client
        self.in_flight = 0
        self.fails = 0       # faults of the server's in a row since its last answer
        self.out = False     # taken out: asked nothing while another server is in
        self.why = ""        # what took it out


class FleetClient(ChatClient):
    """`chat` spread over several servers by least in flight (module docstring); everything else of a
    `ChatClient` (GET /key, /version, /server_info, /generation) is the first server's."""

    def __init__(self, urls: tuple[str, ...], api_key: str, *, concurrency: int,
                 say: Callable[[bool, str], None] | None = None, probe_s: float = PROBE_S,
                 **kwargs: Any) -> None:
        super().__init__(urls[0], api_key, concurrency=concurrency, **kwargs)
        # Each server's pool can take every request of the run (the others may all be out).
        self.members = [Member(url, ChatClient(url, api_key, concurrency=concurrency, **kwargs)) for url in urls]
        self._say = say or (lambda out, text: None)
        self._probe_s = probe_s
        self._probe: asyncio.Task[None] | None = None
        self._redact: Redactor = kwargs.get("redact") or Redactor(api_key)

    def open(self) -> None:
        super().open()
        for m in self.members:
            m.client.open()

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        for m in self.members:
            await m.client.close()
        await super().close()

    def _pick(self, tried: set[int]) -> tuple[int, Member]:
        """The live server with the fewest requests in flight that this request has not tried; with none
        live, the one (out) with the fewest."""
        live = [(m.in_flight, i) for i, m in enumerate(self.members) if not m.out and i not in tried]
        pool = live or [(m.in_flight, i) for i, m in enumerate(self.members) if i not in tried]
        _, i = min(pool)
        return i, self.members[i]

    async def chat(self, body: dict[str, Any], on_generation: Callable[[str], None] | None = None, *,
                   details: bool = False) -> ChatAnswer:
        tried: set[int] = set()
        while True:
            i, m = self._pick(tried)
            m.in_flight += 1
            try:
                answer = await m.client.chat(body, on_generation, details=details)
            except RequestFailed as e:
                self._failed(m, e)
                tried.add(i)
                if e.unreachable and any(not o.out and j not in tried for j, o in enumerate(self.members)):
                    continue  # no connection, nothing sent: asked of the next live server now
                e.server = m.name
                raise
            finally:
                m.in_flight -= 1
            m.fails = 0
            answer.server = m.name
            return answer

    def _failed(self, m: Member, e: RequestFailed) -> None:
        """A server that refused a connection, or failed FAILS_OUT times in a row, is taken out."""
        if e.unreachable:
            self._take_out(m, self._redact(e.message))
            return
        if e.kind in _SERVER_FAULTS or (e.status is not None and e.status >= 500 and e.status != 503):
            m.fails += 1
            if m.fails >= FAILS_OUT:
                self._take_out(m, f"{m.fails} requests in a row failed (the last: {self._redact(e.message)[:160]})")

    def _take_out(self, m: Member, why: str) -> None:
        if m.out:
            return
        m.out, m.why = True, why
        left = sum(not o.out for o in self.members)
        self._say(True, f"server {m.name} taken out of the fleet: {why}; {m.in_flight} request(s) in flight on it "
                        f"are asked again on the {left} server(s) left; it is asked GET /models every "
                        f"{self._probe_s:g} s and comes back at its first answer")
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_out())

    async def _probe_out(self) -> None:
        """Ask every server taken out GET /models every probe_s seconds; one that answers is back."""
        while any(m.out for m in self.members):
            await asyncio.sleep(self._probe_s)
            for m in self.members:
                if not m.out:
                    continue
                try:
                    await m.client.get_json("/models")
                except RequestFailed:
                    continue
                m.out, m.fails, m.why = False, 0, ""
                self._say(False, f"server {m.name} answers GET /models again: back in the fleet")

    def servers(self) -> tuple[tuple[str, str], ...]:
        """(name, why it is out: "" while it is in) per server, in the order listed (the snapshot's)."""
        return tuple((m.name, m.why) for m in self.members)


def answers_differ(first: ChatAnswer, other: ChatAnswer) -> list[str]:
    """What another server's answer to the same smoke request says otherwise than the first server's: the
    model, the prompt's token count and ids (the chat template and tokenizer), whether ids come back.
    Empty when it answers the same way (the texts are sampled: they are not compared)."""
    out = []
    if first.model != other.model:
        out.append(f"it answers as model {other.model!r}, the first as {first.model!r}")
    a, b = first.usage.prompt_tokens, other.usage.prompt_tokens
    if a != b:
        out.append(f"it counts the prompt as {b} tokens, the first as {a} (another chat template or tokenizer)")
    elif first.prompt_token_ids is not None and other.prompt_token_ids is not None \
            and first.prompt_token_ids != other.prompt_token_ids:
        out.append("its prompt ids differ from the first's (another chat template or tokenizer)")
    if (first.token_ids is None) != (other.token_ids is None):
        out.append("it returns no token ids where the first does" if other.token_ids is None
                   else "it returns token ids where the first does not")
    return out
