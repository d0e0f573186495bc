"""Attempts: one prompt asked until it has an outcome.

A request is retried as SPEC.md says (exponential backoff with full jitter, honouring Retry-After)
up to `engine.max_attempts`; every response feeds the dataset's adaptive limit (a 429 cuts it). An
API that cannot be reached at all spends no attempt: the request waits the outage out, however long
it lasts. The loop ends in exactly one `Outcome`; what to record for it is the engine's business.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from draftgen.core.config import Config
from draftgen.core.generate.admission import Gate
from draftgen.core.generate.client import ChatAnswer, ChatClient, RequestFailed
from draftgen.core.generate.stats import Tally
from draftgen.core.live.recent import RecentErrors
from draftgen.core.records import ErrorKind
from draftgen.core.secrets import Redactor

if TYPE_CHECKING:
    from draftgen.core.generate.ledger import DatasetRun


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None,
                  rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base·2^(attempt-1))]), never shorter than Retry-After."""
    delay = rng.uniform(0.0, min(cap, base * (2 ** (attempt - 1))))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap * 5))
    return delay


class Outcome(Enum):
    ANSWERED = "answered"              # record the answer
    FAILED = "failed"                  # failed for good: record the failure
    OUT_OF_CREDITS = "out_of_credits"  # a 402: hand the prompt back and pause the run
    NO_ENDPOINTS = "no_endpoints"      # a 404 "no endpoints": the dataset admits nothing more
    GIVEN_UP = "given_up"              # drained while the API could not be reached: not recorded, stays eligible


@dataclass(frozen=True)
class Attempted:
    outcome: Outcome
    attempts: int
    answer: ChatAnswer | None = None
    error: RequestFailed | None = None


class Attempts:
    """Asks prompts with retries; counts retries and the kinds of error seen; notices outages."""

    def __init__(self, config: Config, gate: Gate, errors: Tally, rng: random.Random, *,
                 retry_slot: Callable[[DatasetRun], Awaitable[None]], on_event: Callable[[str, str, str], None],
                 redact: Redactor, clock: Callable[[], float], recent: RecentErrors | None = None) -> None:
        self._config = config
        self._gate = gate
        self._errors = errors
        self._rng = rng
        self._retry_slot = retry_slot
        self._event = on_event
        self._redact = redact
        self._clock = clock
        self._recent = recent   # the drill-down's rings of recent errors
        self.client: ChatClient | None = None
        self.retries = 0
        self._unreachable_since: float | None = None  # the API could not be reached; reset by an answer

    async def ask(self, ds: DatasetRun, body: dict[str, Any], prompt_id: str = "") -> Attempted:
        assert self.client is not None
        eng = self._config.engine
        attempt = 0
        outage = 0
        while True:
            attempt += 1
            try:
                answer = await self.client.chat(body)
            except RequestFailed as e:
                self._errors.add(e.kind)
                if self._recent is not None:
                    self._recent.add(kind=str(e.kind), dataset=ds.config.name, prompt_id=prompt_id, attempt=attempt,
                                     message=self._redact(e.message), status=e.status,
                                     provider=getattr(e, "provider", None) or "")
                if e.unreachable and not self._gate.stopping:
                    # Nothing was sent: the network or the server is down. Not this prompt's fault, so no
                    # attempt is spent and it waits the outage out however long it lasts; a drain gives it
                    # up unrecorded (it stays eligible). Spending attempts here failed for good every
                    # prompt in flight or admitted during a few minutes' outage.
                    if self._gate.draining:
                        return Attempted(Outcome.GIVEN_UP, attempt - 1, error=e)
                    attempt -= 1
                    outage += 1
                    self.retries += 1
                    self._note_unreachable(e)
                    await asyncio.sleep(backoff_delay(min(outage, 16), eng.backoff_base_s, eng.backoff_max_s,
                                                      None, self._rng))
                    continue
                if e.kind == ErrorKind.RATE_LIMITED:
                    ds.concurrency.on_429()
                else:
                    ds.concurrency.on_response()
                if e.kind == ErrorKind.PAYMENT_REQUIRED:
                    return Attempted(Outcome.OUT_OF_CREDITS, attempt, error=e)
                if e.kind == ErrorKind.NO_ENDPOINTS:
                    return Attempted(Outcome.NO_ENDPOINTS, attempt, error=e)
                if e.retryable and attempt < eng.max_attempts and not self._gate.stopping:
                    self.retries += 1
                    await asyncio.sleep(backoff_delay(attempt, eng.backoff_base_s, eng.backoff_max_s,
                                                      e.retry_after, self._rng))
                    await self._retry_slot(ds)
                    continue
                if self._recent is not None:
                    self._recent.mark_final(ds.config.name, prompt_id)
                return Attempted(Outcome.FAILED, attempt, error=e)
            ds.concurrency.on_response()
            self._note_reachable()
            return Attempted(Outcome.ANSWERED, attempt, answer=answer)

    def _note_unreachable(self, e: RequestFailed) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = self._clock()
            self._event("warn", "unreachable", f"cannot reach {self._config.api.base_url} "
                        f"({self._redact(e.message)[:200]}): retrying until it answers; no prompt is failed "
                        "while it cannot be reached")

    def _note_reachable(self) -> None:
        if self._unreachable_since is not None:
            self._event("info", "reachable", f"{self._config.api.base_url} answers again after "
                        f"{self._clock() - self._unreachable_since:.0f} s out of reach")
            self._unreachable_since = None
