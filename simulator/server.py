"""`SimServer`: an OpenRouter-compatible HTTP API on loopback, with latency, a provider mix,
credits and faults, for tests, the demo, benchmarks and rehearsals.

    async with SimServer(SimConfig(seed=1, latency_scale=0), port=0) as sim:
        sim.base_url   # "http://127.0.0.1:PORT/api/v1"
        sim.stats      # a SimStats copy: requests, peak in flight, faults, per-prompt counts
        sim.sent       # with SimConfig(sent_log_size=N): the latest N requests' messages, as received

Endpoints, one module each: POST /api/v1/chat/completions, JSON or SSE (completions.py);
GET /api/v1/credits and /api/v1/key (account.py); GET /api/v1/generation?id= and the billing
(generations.py); GET /api/v1/models and /api/v1/models/{author}/{slug}/endpoints (models.py); GET /health
and /api/health (200, for a router in front: docs/routers.md);
/_sim/stats, /_sim/config, /_sim/scenario (control.py). Scenarios: scenarios.py.

Every random choice of a request (provider, fault, answer, jitter) is drawn from a hash of the
seed, the prompt and how many times that prompt was asked, so a seeded run is repeatable
whatever order concurrent requests arrive in. Nothing is tokenized on the request path: answers
come from a pool tokenized at startup.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from draftgen.simulator import control
from draftgen.simulator.account import Account, auth_error
from draftgen.simulator.answers import AnswerPool, build_pool
from draftgen.simulator.completions import Completions
from draftgen.simulator.config import FIXED_AT_START, SimConfig, SimulatorError
from draftgen.simulator.generations import Generations
from draftgen.simulator.models import Models
from draftgen.simulator.scenarios import Scenarios
from draftgen.simulator.stats import Sent, SimStats

API = "/api/v1"


async def _healthy(_: web.Request) -> web.Response:
    return web.Response(status=200)


class SimServer:
    """The simulator's HTTP server; use as an async context manager (or start()/close())."""

    def __init__(self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._cfg = config or SimConfig()
        self._host = host
        self._port = port
        self._stats = SimStats()
        self._pool: AnswerPool | None = None
        self._runner: web.AppRunner | None = None
        self.scenarios = Scenarios()
        self.account = Account(self._stats, lambda: self._cfg, self.scenarios)
        self.generations = Generations(self._stats, lambda: self._cfg, self.account.finished)
        self.models = Models(lambda: self._cfg, self.scenarios)
        self._completions = Completions(self._stats, lambda: self._cfg, self._answer_pool, self.scenarios,
                                        self.account, self.generations, self.models)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self._cfg
        for name, params in cfg.scenarios.items():  # `after` counts from here
            self.scenario(name, True, **params)
        self._pool = await asyncio.to_thread(build_pool, cfg.seed, cfg.mean_completion_tokens,
                                             cfg.length_sigma, cfg.pool_size)
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post(f"{API}/chat/completions", self._completions.handle)
        app.router.add_get(f"{API}/credits", self.account.credits)
        app.router.add_get(f"{API}/key", self.account.key)
        app.router.add_get(f"{API}/auth/key", self.account.key)
        app.router.add_get(f"{API}/generation", self._authed(self.generations.handle))
        app.router.add_get(f"{API}/models", self.models.list_models)
        app.router.add_get(API + "/models/{author}/{slug}/endpoints", self._authed(self.models.endpoints))
        # GET /health answers 200 as vLLM's and SGLang's do, at the root and under /api: a router
        # (sglang-router, vllm-router) given http://HOST:PORT/api as a worker probes {worker}/health
        # before it routes to it, then posts to {worker}/v1/chat/completions (docs/routers.md).
        app.router.add_get("/health", _healthy)
        app.router.add_get("/api/health", _healthy)
        control.add_routes(app, self)
        # access_log off: at thousands of requests a second the log line costs more than the
        # answer. handler_cancellation: a client that gives up cancels its handler, so
        # in_flight counts what is really open. A short shutdown: hung requests do not hold
        # up close().
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=0.25)
        await self._runner.setup()
        # The backlog must hold a burst of 2,000+ simultaneous connects.
        site = web.TCPSite(self._runner, self._host, self._port, backlog=8192, reuse_address=True)
        await site.start()
        self._port = self._runner.addresses[0][1]

    async def close(self) -> None:
        self.generations.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what tests use --------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"http://{host}:{self._port}{API}"

    @property
    def config(self) -> SimConfig:
        return self._cfg

    @property
    def stats(self) -> SimStats:
        """A copy of the counters as they are now."""
        return self._stats.copy()

    @property
    def sent(self) -> tuple[Sent, ...]:
        """The latest chat requests as received, oldest first: each one's `messages` and the
        `usage.prompt_tokens` it counted. Kept only with `SimConfig.sent_log_size` > 0 (that many)."""
        return tuple(self._completions.sent)

    @property
    def balance(self) -> float:
        return self.account.balance()

    def _answer_pool(self) -> AnswerPool:
        assert self._pool is not None, "SimServer.start() builds the answer pool"
        return self._pool

    def _authed(self, handler: Any) -> Any:
        async def authed(request: web.Request) -> web.StreamResponse:
            if (denied := auth_error(request, self._cfg, self.scenarios)) is not None:
                return denied
            return await handler(request)
        return authed

    def update(self, **changes: Any) -> SimConfig:
        """Change settings at runtime (fault rates, credits, latency...); requests already in
        flight finish under the settings they started with."""
        fixed = sorted(k for k in changes if k in FIXED_AT_START and changes[k] != getattr(self._cfg, k))
        if fixed:
            raise SimulatorError(f"simulator config: {', '.join(fixed)} cannot change while running "
                                 "(they shape the answer pool built at startup)")
        self._cfg = self._cfg.replace(**changes)
        self._completions.forget_routes()
        if "scenarios" in changes:
            self.scenarios.clear()
            for name, params in self._cfg.scenarios.items():
                self.scenario(name, True, **params)
        return self._cfg

    def set_balance(self, usd: float) -> None:
        """Make the remaining credit `usd` (0 starts 402s; a later top-up ends them)."""
        self.update(credits=self._stats.billed_usd + float(usd))

    def scenario(self, name: str, on: bool = True, **params: Any) -> None:
        """Switch a scenario (see scenarios.py) on, with parameters, or off."""
        on_start: dict[str, Any] = {}
        if name == "key_limit" and "limit" not in params:
            on_start["limit"] = self._stats.billed_usd  # the cap is reached now
        self.scenarios.switch(name, on, params, on_start=on_start)
