"""A fleet of self-hosted servers behind one run: `[api] base_url` given as a list of URLs.

`FleetClient` is a `ChatClient` whose `chat` asks one of its servers (`Member`), each with its own
connection pool, its own count of requests in flight and its own adaptive limit (`ServerLimit`: the
engine passes loop/concurrency.py's `AdaptiveConcurrency`), configured at the run's concurrency shared
evenly (ceil(total / servers)): a request goes to the live server not in a storm of its own with room
(in flight below its limit) and the fewest in flight for its limit (ties: fewer in flight, then the first
listed); when every such server is at its limit, to the one least full for its limit (in flight / limit),
so the fleet never holds a request the run admitted (a pause stays a pause: admission decides what is
sent).

A server in a 429 storm (below) answers at once, so it always has room: counting requests in flight would
send it attempt after attempt (1,297 429s in 8 s in tests/servers/test_fleet.py's storm test). While
another live server is not in a storm, a storming one gets a request only as a probe: at most one every
STORM_PROBE_S seconds, and only with room under its cut limit. Probing (rather than asking it only when
every other server is full) keeps its share bounded by time, not by how full the others are: when they are
full, their extra requests queue on servers that answer instead of bouncing off one that does not (each
bounce is an attempt and a retry's wait for that prompt). The probes are its 429s that keep the storm
seen (2 a second: 10 a window, the storm rule's 5 at least) and its first answers that end it: 5 s
without a storm's 429s, as with one URL. With every live server in a storm, they share requests by room
and fullness as above.

A server's limit is cut by its own 429 storms (the trickle-vs-storm rule of AdaptiveConcurrency, counted
over the attempts sent to that server): its 429s, its 503s (a full queue) and its timeouts. The others'
limits are not touched, and such a failure does not cut the dataset's limit (`RequestFailed.fleet_limited`)
unless every live server is in a storm at once: then the fleet as a whole is overloaded and the run's
limit is cut as with one base_url. Each server's storm start, end and its limit back are said once each
(`say_limit`: concurrency events naming the server), and its limit is in the snapshot (`limits`).

A server is taken out of the fleet when

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
import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from draftgen.core.bodies import ChatBody
from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.live.payloads import Concurrency
from draftgen.core.records import ErrorKind
from draftgen.core.secrets import Redactor

FAILS_OUT = 5        # a server's faults in a row (no answer between) that take it out of the fleet
PROBE_S = 5.0        # how often a server taken out is asked GET /models
STORM_PROBE_S = 0.5  # a server in a storm, with another not in one: one request every so often
_SERVER_FAULTS = frozenset({ErrorKind.CONNECTION, ErrorKind.BAD_BODY, ErrorKind.TIMEOUT})


class ServerLimit(Protocol):
    """A server's adaptive limit as the fleet uses it (loop/concurrency.py `AdaptiveConcurrency`, made by
    the caller: the api layer does not import the loop's)."""
    configured: int

    @property
    def limit(self) -> int: ...
    @property
    def in_storm(self) -> bool: ...
    def on_send(self) -> float: ...
    def on_429(self, sent_at: float | None = None) -> None: ...
    def tick(self) -> bool: ...


# A server's limit from its configured value and where its storms are said (a `Concurrency` payload each).
LimitFactory = Callable[[int, Callable[[Concurrency], None]], ServerLimit]


def server_name(url: str) -> str:
    """The URL as records and panels name the server: without user, password, query or fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class Member:
    """One server of the fleet: its client, what it has in flight, its adaptive limit, whether it is in
    the fleet."""

    __slots__ = ("url", "name", "client", "in_flight", "limit", "fails", "out", "why", "probe_at")

    def __init__(self, url: str, client: ChatClient, limit: ServerLimit) -> None:
        self.url = url
        self.name = server_name(url)
        self.client = client
        self.in_flight = 0
        self.limit = limit   # its own: cut by its 429 storms only
        self.fails = 0       # faults of the server's in a row since its last answer
        self.out = False     # taken out: asked nothing while another server is in
        self.why = ""        # what took it out
        self.probe_at = 0.0  # in a storm: when it may be sent its next probe (time.monotonic)


class FleetClient(ChatClient):
    """`chat` spread over several servers by least in flight (module docstring); everything else of a
    `ChatClient` (GET /key, /version, /server_info, /generation) is the first server's."""

    def __init__(self, urls: tuple[str, ...], api_key: str, *, concurrency: int, limits: LimitFactory,
                 say: Callable[[bool, str], None] | None = None, probe_s: float = PROBE_S,
                 say_limit: Callable[[Concurrency], None] | None = None, **kwargs: Any) -> None:
        super().__init__(urls[0], api_key, concurrency=concurrency, **kwargs)
        share = -(-concurrency // len(urls))  # each server's configured limit: the run's shared evenly
        # Each server's pool can take every request of the run (the others may all be out or full).
        self.members = [Member(url, ChatClient(url, api_key, concurrency=concurrency, **kwargs),
                               limits(share, self._limit_said(server_name(url))))
                        for url in urls]
        self._say = say or (lambda out, text: None)
        self._say_limit = say_limit or (lambda change: None)
        self._probe_s = probe_s
        self._probe: asyncio.Task[None] | None = None
        self._grow: asyncio.Task[None] | None = None
        self._redact: Redactor = kwargs.get("redact") or Redactor(api_key)

    def open(self) -> None:
        super().open()
        for m in self.members:
            m.client.open()

    async def close(self) -> None:
        for task in (self._probe, self._grow):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._probe = self._grow = None
        for m in self.members:
            await m.client.close()
        await super().close()

    def _limit_said(self, name: str) -> Callable[[Concurrency], None]:
        """What server `name`'s adaptive limit says (its storm's start and end, its limit back), named."""
        return lambda change: self._say_limit(dataclasses.replace(change, server=name))

    def _pick(self, tried: set[int]) -> tuple[int, Member]:
        """The server this request goes to, of those it has not tried (module docstring): with a live server
        not in a storm, a storming one due a probe (with room), else of those not in a storm the one with room
        and the fewest in flight for its limit, else the least full for its limit; with every live one in a
        storm, the same among them; with none live, the one (out) with the fewest in flight."""
        untried = [(i, m) for i, m in enumerate(self.members) if i not in tried]
        live = [(i, m) for i, m in untried if not m.out]
        if not live:
            _, i = min((m.in_flight, i) for i, m in untried)
            return i, self.members[i]
        calm = [(i, m) for i, m in live if not m.limit.in_storm]
        if calm and len(calm) < len(live):
            now = time.monotonic()
            due = [(m.probe_at, i) for i, m in live
                   if m.limit.in_storm and m.probe_at <= now and m.in_flight < m.limit.limit]
            if due:
                _, i = min(due)
                self.members[i].probe_at = now + STORM_PROBE_S
                return i, self.members[i]
        pool = calm or live
        full = [(m.in_flight / m.limit.limit, m.in_flight, i) for i, m in pool]
        room = [f for f, (_, m) in zip(full, pool) if m.in_flight < m.limit.limit]
        _, _, i = min(room or full)
        return i, self.members[i]

    async def chat(self, body: ChatBody, on_generation: Callable[[str], None] | None = None, *,
                   details: bool = False) -> ChatAnswer:
        if self._grow is None:
            self._grow = asyncio.get_running_loop().create_task(self._grow_limits())
        tried: set[int] = set()
        while True:
            i, m = self._pick(tried)
            m.in_flight += 1
            sent_at = m.limit.on_send()
            try:
                answer = await m.client.chat(body, on_generation, details=details)
            except RequestFailed as e:
                self._failed(m, e)
                self._slowed(m, e, sent_at)
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

    def _slowed(self, m: Member, e: RequestFailed, sent_at: float) -> None:
        """A 429, a full queue's 503 or a timeout of server `m`'s: its own limit hears it (a storm cuts it),
        counted at its attempt's send time as the dataset's limit counts them (concurrency.py `on_429`).
        The dataset's limit is left alone (`fleet_limited`) while another live server is not in a storm."""
        if not (e.slow_down or e.status == 503 or e.kind is ErrorKind.TIMEOUT):
            return
        m.limit.on_429(sent_at)
        e.fleet_limited = any(not o.out and not o.limit.in_storm for o in self.members)

    async def _grow_limits(self) -> None:
        """Every second: the servers' limits cut by their storms grow back (for the life of the client)."""
        while True:
            await asyncio.sleep(1.0)
            for m in self.members:
                m.limit.tick()

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

    def limits(self) -> dict[str, tuple[int, int]]:
        """Per server: (its adaptive limit now, its configured limit) (the snapshot's)."""
        return {m.name: (m.limit.limit, m.limit.configured) for m in self.members}


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
