"""What the service did for a run's requests, shared by all of them: the answers and answer faults it
gave (the evidence a prompt's own fault is weighed against, request.py), the requests backing off,
how long it has been out of reach and why, and what was said once.

One `Service` per run (run_loop.py builds it); every `Request` of the run reads and counts into it.
The pure policy beside it: `backoff_delay` (full jitter, Retry-After honoured), also the smoke test's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import unreachable_advice
from draftgen.core.generate.api.client import ChatClient, RequestFailed
from draftgen.core.generate.api.preflight import detect_server
from draftgen.core.generate.loop.context import RunContext
from draftgen.core.generate.money.spend import Ticket
from draftgen.core.live import payloads as ev
from draftgen.core.live.events import EventKind, Payload
from draftgen.core.records import ErrorKind
from draftgen.core.servers import ids_plan, missing_ids_message

ANSWER_BLOCK_BITS = 3  # answers are counted by blocks of 8 sends: a prompt's count starts at the next block


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None,
                  rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt-1))]), never shorter than Retry-After."""
    delay = rng.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap * 5))
    return delay


class Service:
    """The run-wide counts and notes every request of a run shares (not one request's own state: that
    is its `Request`)."""

    def __init__(self, ctx: RunContext, client: ChatClient, rng: random.Random) -> None:
        self._ctx = ctx
        self.client = client
        self.rng = rng            # the backoff's jitter
        self.tasks: set[asyncio.Task[Any]] = set()  # the coroutines asking a request now (stop now cancels them)
        self.retries = 0
        self.unreachable_since: float | None = None  # the API could not be reached; reset by an answer
        self.unreachable_cause = ""  # e.g. "cannot connect to 127.0.0.1:18799 (connection refused)"
        self.answered = 0        # answers this run: a prompt that fails while others are answered is suspect
        self.sent = 0            # requests sent this run, numbered in the order they left
        self.answered_blocks: list[int] = []  # answers, by the block of ANSWER_BLOCK_BITS of their send number
        self.answer_faults = 0   # answer faults this run (ANSWER_KINDS)
        self.backing_off = 0     # requests waiting to retry a transient error right now
        self.last_transient: RequestFailed | None = None
        self._said: dict[tuple[EventKind, str], int] = {}  # (event kind, provider) -> times seen
        self._doubts_said: set[str] = set()  # the kinds of bill not believed, said once each
        api = ctx.config.api
        self.wants_ids = api.return_token_ids and api.server.kind.returns_ids
        self._ids_said = False  # why answers come without the server's ids was said

    # -- the evidence a prompt's answer faults are weighed against -----------------------------------

    def answered_since(self, first_block: int) -> int:
        """Answers to requests sent from block `first_block` on."""
        return sum(self.answered_blocks[first_block:])

    def note_answer(self, sent_no: int) -> None:
        """An answer to the `sent_no`th request sent: counted, and the end of an outage said."""
        self.answered += 1
        blocks, block = self.answered_blocks, sent_no >> ANSWER_BLOCK_BITS
        while len(blocks) <= block:
            blocks.append(0)
        blocks[block] += 1
        if (since := self.unreachable_since) is not None:
            ctx = self._ctx
            ctx.event(ev.Reachable(url=ctx.config.api.base_url, out_s=ctx.clock() - since))
            self.unreachable_since = None

    # -- outages -------------------------------------------------------------------------------------

    def stalled(self, in_flight: int) -> str:
        """Why no answer comes while the run goes, in a sentence (empty when answers come)."""
        since = self.unreachable_since
        base_url = self._ctx.config.api.base_url
        if since is not None:
            cause = self.unreachable_cause or f"{base_url} does not answer"
            return (f"{cause} for {self._ctx.clock() - since:.0f} s; retrying until it answers "
                    f"({unreachable_advice(base_url, cause)}), no prompt is failed meanwhile")
        last = self.last_transient
        if self.backing_off and self.backing_off >= in_flight and last is not None:
            wait = f", Retry-After {last.retry_after:g} s" if last.retry_after is not None else ""
            return (f"all {self.backing_off} requests in flight are backing off a transient error "
                    f"({last.kind}{wait}): {self._ctx.redact(last.message)[:120]}")
        return ""

    def note_unreachable(self, e: RequestFailed) -> None:
        ctx = self._ctx
        self.unreachable_cause = ctx.redact(e.message)[:200]
        if self.unreachable_since is None:
            self.unreachable_since = ctx.clock()
            # The cause once (it names the address), the advice that matches it, then what the run does.
            cause = self.unreachable_cause
            advice = unreachable_advice(ctx.config.api.base_url, cause, ctx.config.path)
            ctx.event(ev.Unreachable(cause=cause, advice=advice))

    # -- said once, or sparingly ---------------------------------------------------------------------

    def say(self, kind: EventKind, provider: str, payload: Callable[[str, int], Payload]) -> None:
        """A provider's billing past what was asked: said the 1st, 10th, 100th... time per provider, as the
        payload `payload` makes of the provider's (redacted) name and the times so far."""
        ctx = self._ctx
        who = ctx.redact(provider) or "(unnamed provider)"
        n = self._said[kind, who] = self._said.get((kind, who), 0) + 1
        if n == 1 or (n % 10 == 0 and str(n).rstrip("0") == "1"):
            ctx.event(payload(who, n))

    def doubted(self, name: str, ticket: Ticket, answer: ChatAnswer) -> None:
        """An answer whose bill is not believed (billing.py `believed`): counted (bad_bill), and said once per
        kind of doubt with what it is booked at instead."""
        ctx = self._ctx
        ctx.errors.add(ErrorKind.BAD_BILL)
        if answer.doubt in self._doubts_said:
            return
        self._doubts_said.add(answer.doubt)
        who = ctx.redact(answer.provider or "") or "(unnamed provider)"
        counts = answer.usage.prompt_tokens or answer.usage.completion_tokens
        instead = ("its generation record's cost (checked the same way)" if ticket.gen else
                   "its token counts at the worst prices" if counts else f"its worst case ${ticket.worst:.6f}")
        ctx.event(ev.BadBill(provider=who, prompt_id=ticket.prompt_id, doubt=str(answer.doubt), instead=instead,
                             dataset=name))

    # -- the self-hosted server's token ids ---------------------------------------------------------

    async def server_ids(self) -> None:
        """Which server and release answer (asked once, if the start-up check did not), and an event
        saying how its ids are asked in this run's mode, or why they cannot be."""
        if not self.wants_ids:
            return
        config = self._ctx.config
        if not config.api.server.asked:
            await detect_server(config, self.client)
        asked, text = ids_plan(config.api.server.release, config.api.base_url, config.api.streams)
        self._ids_said = not asked  # the reason is said once, here: each answer without ids is still counted
        self._ctx.event(ev.ServerIds(detail=text, asked=asked))

    def no_ids(self, name: str) -> None:
        """An answer without the ids asked for: counted (no_ids), and said once with the fix."""
        self._ctx.errors.add(ErrorKind.NO_IDS)
        if not self._ids_said:
            self._ids_said = True
            api = self._ctx.config.api
            self._ctx.event(ev.ServerIds(detail=missing_ids_message(api.server.release, api.base_url, api.streams),
                                         dataset=name))
