"""Billing as OpenRouter bills, and the generation records `GET /api/v1/generation?id=` returns.

- A generation is charged when it finishes, at its provider's prices (prompt tokens x
  `pricing.prompt` + completion tokens x `pricing.completion`).
- A non-streamed request keeps running when the client gives up on it (timeout, dropped
  connection, killed process) and is charged in full when it would have finished (a timer
  set when the handler learns the client left).
- An aborted stream stops the generation: it is charged for the prompt and the completion
  tokens produced until the cancel (produced at the provider's pace from the first token, so
  never fewer than the client received), and its record says `cancelled: true`.
- A record appears `generation_delay_s` (as set now) after the generation ends; before that the
  id is a 404, as an unknown id is. A generation that failed at the provider (an error inside a
  200) gets one too, with total_cost 0: every generation id has a record.

Every charge goes to `SimStats.billed_usd` and, per prompt, to `prompt_answers` (generations
billed) and `prompt_cost`, so a test can compare a client's ledger with what was billed.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from draftgen.simulator import responses
from draftgen.simulator.answers import Completion
from draftgen.simulator.config import SimConfig, SimProvider
from draftgen.simulator.stats import SimStats


@dataclass(eq=False, slots=True)
class Generation:
    """One generation under way at a provider."""

    gen_id: str
    key: str  # the prompt's key (stats.prompt_key)
    provider: SimProvider
    model: str
    created: int
    prompt_tokens: int
    completion: Completion
    billed_tokens: int  # what usage reports (the drift knob may make it differ by one)
    streamed: bool
    ttft: float
    latency: float
    estimate: float  # worst-case cost, for the in-flight budget
    started: float = field(default_factory=time.monotonic)
    cost: float | None = None  # set once billed
    timer: asyncio.TimerHandle | None = None

    def cost_of(self, tokens: int) -> float:
        p = self.provider
        return (self.prompt_tokens * p.usd_per_m_in + tokens * p.usd_per_m_out) / 1e6

    @property
    def full_cost(self) -> float:
        return self.cost_of(self.billed_tokens)

    def produced(self, now: float) -> int:
        """Completion tokens produced by `now`, at the provider's pace after the first token."""
        gen_time = self.latency - self.ttft
        if gen_time <= 0:
            return self.billed_tokens if now - self.started >= self.latency else 0
        share = min(1.0, max(0.0, (now - self.started - self.ttft) / gen_time))
        return int(self.billed_tokens * share)


class Generations:
    """Generations running, what they were billed, and their records."""

    def __init__(self, stats: SimStats, config: Callable[[], SimConfig],
                 on_finish: Callable[[Generation], None]) -> None:
        self._stats = stats
        self._config = config
        self._on_finish = on_finish  # the account's in-flight book hears of each finish
        self.running: dict[str, Generation] = {}
        self._closed = False
        # gen_id -> (finished at, generation, completion tokens billed, cancelled); oldest first.
        self._records: OrderedDict[str, tuple[float, Generation, int, bool]] = OrderedDict()

    def start(self, g: Generation) -> None:
        """The generation runs; whoever serves it calls finish() at its end, or abandoned()."""
        self.running[g.gen_id] = g
        self._stats.generations_running = len(self.running)
        if g.latency <= 0:
            self.finish(g)

    def abandoned(self, g: Generation) -> None:
        """Nobody will read `g` (the client left, or the connection was dropped): a stream stops
        and is billed so far; a plain request runs on and is billed in full at its end."""
        if g.cost is not None or g.timer is not None or self._closed:
            return
        if g.streamed:
            self.finish(g, cancelled=True)
            return
        left = g.started + g.latency - time.monotonic()
        if left <= 0:
            self.finish(g)
        else:
            g.timer = asyncio.get_running_loop().call_later(left, self.finish, g)

    def finish(self, g: Generation, *, cancelled: bool = False) -> float:
        """Bill `g` once: in full, or (a cancelled stream) what it produced so far. Returns the cost."""
        if g.cost is not None:
            return g.cost
        now = time.monotonic()
        if g.timer is not None:
            g.timer.cancel()
            g.timer = None
        tokens = g.produced(now) if cancelled else g.billed_tokens
        g.cost = cost = g.cost_of(tokens)
        self.running.pop(g.gen_id, None)
        st = self._stats
        st.generations_running = len(self.running)
        st.billed_usd += cost
        st.generations_billed += 1
        st.cancelled_total += cancelled
        st.completion_tokens_total += tokens
        st.prompt_answers[g.key] = st.prompt_answers.get(g.key, 0) + 1
        st.prompt_cost[g.key] = st.prompt_cost.get(g.key, 0.0) + cost
        self._on_finish(g)
        self._keep(g.gen_id, (now, g, tokens, cancelled))
        return cost

    def _keep(self, gen_id: str, entry: tuple[float, Generation, int, bool]) -> None:
        # Compact: up to generation_log_size of these are kept; the record is built when asked for.
        self._records[gen_id] = entry
        while len(self._records) > self._config().generation_log_size:
            self._records.popitem(last=False)

    def failed(self, g: Generation) -> None:
        """`g` failed at the provider before any billing (an error inside a 200): its record says
        total_cost 0, so a client that abandoned it can price it."""
        if g.cost is None and g.gen_id not in self._records:
            g.cost = 0.0
            self._keep(g.gen_id, (time.monotonic(), g, 0, False))

    def record(self, gen_id: str) -> dict[str, Any] | None:
        found = self._records.get(gen_id)
        # The delay is read now, so a test can hold records back and then release them.
        if found is None or time.monotonic() < found[0] + self._config().generation_delay_s:
            return None
        ended, g, tokens, cancelled = found
        finish = None if cancelled else g.completion.finish_reason
        return {
            "id": g.gen_id, "upstream_id": f"chatcmpl-{g.gen_id[4:]}", "total_cost": g.cost, "usage": g.cost,
            "cache_discount": None, "created_at": _iso(g.created), "model": g.model, "app_id": None,
            "streamed": g.streamed, "cancelled": cancelled, "provider_name": g.provider.name,
            "latency": round(g.ttft * 1000), "generation_time": round((ended - g.started) * 1000),
            "moderation_latency": None, "finish_reason": finish, "native_finish_reason": finish,
            "tokens_prompt": g.prompt_tokens, "tokens_completion": tokens,
            "native_tokens_prompt": g.prompt_tokens, "native_tokens_completion": tokens,
            "native_tokens_reasoning": min(g.completion.n_reasoning, tokens), "native_tokens_cached": 0,
            "num_media_prompt": None, "num_media_completion": None, "num_search_results": None,
            "origin": "", "is_byok": False,
        }

    def close(self) -> None:
        """Server shutdown: generations still running are never billed."""
        self._closed = True
        for g in self.running.values():
            if g.timer is not None:
                g.timer.cancel()
        self.running.clear()
        self._stats.generations_running = 0

    async def handle(self, request: web.Request) -> web.Response:
        """GET /api/v1/generation?id=: the record, or 404 until it appears."""
        gen_id = request.query.get("id", "")
        found = self.record(gen_id)
        if found is None:
            return responses.error(404, f"Generation {gen_id!r} not found")
        return responses.json_response({"data": found})


def _iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(ts))
