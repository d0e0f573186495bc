"""`SimServer`: an OpenRouter-compatible HTTP API on loopback, with latency, a provider mix,
credits and faults, for tests, the demo, benchmarks and rehearsals.

    async with SimServer(SimConfig(seed=1, latency_scale=0), port=0) as sim:
        sim.base_url   # "http://127.0.0.1:PORT/api/v1"
        sim.stats      # a SimStats copy: requests, peak in flight, faults, per-prompt counts

Endpoints: POST /api/v1/chat/completions (JSON or SSE), GET /api/v1/credits, /api/v1/key,
/api/v1/generation?id=; control: GET /_sim/stats[?prompts=0], GET /_sim/config, POST /_sim/config
(a JSON patch of SimConfig fields, plus "balance" to set the remaining credit).

Every random choice of a request (provider, fault, answer, jitter) is drawn from a hash of the
seed, the prompt and how many times that prompt was asked, so a seeded run is repeatable
whatever order concurrent requests arrive in. Nothing is tokenized on the request path: answers
come from a pool tokenized at startup.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import orjson
from aiohttp import web

from draftgen.core.simulator import responses, wire
from draftgen.core.simulator.answer_text import style_of_prompt
from draftgen.core.simulator.answers import AnswerPool, answer_tokenizer, build_pool
from draftgen.core.simulator.config import FIXED_AT_START, SimConfig, SimProvider, SimulatorError
from draftgen.core.simulator.faults import pick_fault, serve_fault
from draftgen.core.simulator.prompt import prompt_token_count
from draftgen.core.simulator.routing import NoEndpoints, candidates, choose
from draftgen.core.simulator.stats import SimStats

API = "/api/v1"
_U32 = float(1 << 32)


class SimServer:
    """The simulator's HTTP server; use as an async context manager (or start()/close())."""

    def __init__(self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._cfg = config or SimConfig()
        self._host = host
        self._port = port
        self._stats = SimStats()
        self._pool: AnswerPool | None = None
        self._runner: web.AppRunner | None = None
        self._generations: dict[str, tuple[Any, ...]] = {}
        self._gen_counter = 0
        self._fragments: wire.FragmentCache = {}
        self._route_cache: dict[tuple[bytes, str, int], list[SimProvider] | NoEndpoints] = {}
        self._prompt_cache: dict[tuple[str, str | None], int] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self._cfg
        self._pool = await asyncio.to_thread(build_pool, cfg.seed, cfg.mean_completion_tokens,
                                             cfg.length_sigma, cfg.pool_size)
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post(f"{API}/chat/completions", self._chat)
        app.router.add_get(f"{API}/credits", self._credits)
        app.router.add_get(f"{API}/key", self._key)
        app.router.add_get(f"{API}/auth/key", self._key)
        app.router.add_get(f"{API}/generation", self._generation)
        app.router.add_get("/_sim/stats", self._sim_stats)
        app.router.add_get("/_sim/config", self._sim_get_config)
        app.router.add_post("/_sim/config", self._sim_post_config)
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
    def balance(self) -> float:
        return self._cfg.credits - self._stats.billed_usd

    def update(self, **changes: Any) -> SimConfig:
        """Change settings at runtime (fault rates, credits, latency...); requests already in
        flight finish under the settings they started with."""
        fixed = sorted(k for k in changes if k in FIXED_AT_START and changes[k] != getattr(self._cfg, k))
        if fixed:
            raise SimulatorError(f"simulator config: {', '.join(fixed)} cannot change while running "
                                 "(they shape the answer pool built at startup)")
        self._cfg = self._cfg.replace(**changes)
        self._route_cache.clear()
        return self._cfg

    def set_balance(self, usd: float) -> None:
        """Make the remaining credit `usd` (0 starts 402s; a later top-up ends them)."""
        self.update(credits=self._stats.billed_usd + float(usd))

    # -- chat completions ------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        st = self._stats
        st.requests_total += 1
        st.in_flight += 1
        if st.in_flight > st.peak_in_flight:
            st.peak_in_flight = st.in_flight
        status = "?"
        cfg = self._cfg
        try:
            resp = await self._serve_chat(request, cfg)
            status = str(resp.status)
            if cfg.echo_key:
                _echo_key(request, resp)
            return resp
        except asyncio.CancelledError:
            status = request.get(responses.NO_RESPONSE, "cancelled")
            raise
        except ConnectionError:
            # The client left mid-stream before aiohttp noticed; a stand-in response lets aiohttp
            # see the closed connection itself instead of logging a handler error.
            status = "cancelled"
            return web.Response(status=499)
        finally:
            st.in_flight -= 1
            st.by_status[status] = st.by_status.get(status, 0) + 1

    async def _serve_chat(self, request: web.Request, cfg: SimConfig) -> web.StreamResponse:
        if (denied := _auth_error(request, cfg)) is not None:
            return denied
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return responses.error(400, "Invalid JSON in request body")
        if not isinstance(body, dict):
            return responses.error(400, "Request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return responses.error(400, "Input required: specify \"messages\" (a non-empty list)")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return responses.error(400, "\"model\" is required")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            return responses.error(400, f"max_tokens must be a positive integer, got {max_tokens!r}")

        st = self._stats
        key_json = orjson.dumps(messages)
        key = hashlib.sha1(key_json).hexdigest()
        n = st.prompt_requests.get(key, 0) + 1
        st.prompt_requests[key] = n
        draws = _draws(cfg.seed, key, n)

        prefs = body.get("provider")
        routes = self._routes(cfg, prefs, model)
        if isinstance(routes, NoEndpoints):
            return responses.error(404, routes.message)
        provider = choose(routes, prefs, draws[0], draws[1], cfg.fallback_rate)

        balance = cfg.credits - st.billed_usd
        if balance <= 0:
            return responses.error(402, "Insufficient credits. "
                                        "Add more using https://openrouter.ai/settings/credits")
        affordable = int(balance / (provider.usd_per_m_out / 1e6)) if provider.usd_per_m_out > 0 else 1 << 62
        if max_tokens is not None and affordable < max_tokens:
            return responses.error(402, "This request requires more credits, or fewer max_tokens. You requested "
                                        f"up to {max_tokens} tokens, but can only afford {affordable}. To increase, "
                                        "visit https://openrouter.ai/settings/credits and add more credits")
        if cfg.max_in_flight is not None and st.in_flight > cfg.max_in_flight:
            st.faults["max_in_flight"] = st.faults.get("max_in_flight", 0) + 1
            return responses.rate_limited(cfg, provider.name)

        fault = pick_fault(cfg.faults, draws[2])
        think, show = _reasoning_mode(body)
        # The answer depends on the seed and the prompt only: a retry gets the same text.
        answer = self._pool.pick(style_of_prompt(_last_user_text(messages)),
                                 int(key[:15], 16) + cfg.seed * 0x9E3779B97F4A7C15)
        completion = self._pool.complete(answer, max_tokens, think)
        billed_tokens = completion.completion_tokens
        if draws[4] < cfg.tokens_drift:
            billed_tokens = max(1, billed_tokens + (1 if draws[5] < 0.5 else -1))
        prompt_tokens = self._prompt_tokens(key, messages, cfg.default_system)
        if provider.token_skew:
            billed_tokens = max(1, round(billed_tokens * (1 + provider.token_skew)))
            prompt_tokens = max(1, round(prompt_tokens * (1 + provider.token_skew)))
        cost = (prompt_tokens * provider.usd_per_m_in + billed_tokens * provider.usd_per_m_out) / 1e6

        self._gen_counter += 1
        gen_id = f"gen-{int(time.time())}-{key[:8]}{n:x}{self._gen_counter:x}"
        reply = wire.Reply(gen_id, provider.name, model, int(time.time()), completion, think and show,
                           cfg.reasoning_field, body.get("return_token_ids") is True,
                           wire.usage(prompt_tokens, billed_tokens, completion.n_reasoning, cost))
        latency, ttft = _latency(cfg, provider, completion.completion_tokens, draws[6], draws[7])

        if fault is not None:
            st.faults[fault] = st.faults.get(fault, 0) + 1
            return await serve_fault(request, cfg, fault, reply, ttft, latency, bool(body.get("stream")),
                                     self._fragments)
        if body.get("stream"):
            return await self._stream(request, cfg, reply, ttft, latency, key, provider.name)
        if latency > 0:
            await asyncio.sleep(latency)
        self._bill(reply, key, provider.name, latency, streamed=False)
        data = wire.completion_json(reply, self._fragments)
        if cfg.misbehave:
            data = _misbehave(data, cfg, prefs)
        return web.Response(body=data, content_type=responses.JSON)

    def _prompt_tokens(self, key: str, messages: list[Any], system: str | None) -> int:
        # Memoised per prompt: retries and repeated prompts are not tokenized again.
        found = self._prompt_cache.get((key, system))
        if found is None:
            if len(self._prompt_cache) > 65536:
                self._prompt_cache.clear()
            found = self._prompt_cache[(key, system)] = prompt_token_count(answer_tokenizer(), messages, system)
        return found

    def _routes(self, cfg: SimConfig, prefs: Any, model: str) -> list[SimProvider] | NoEndpoints:
        # Memoised: a run sends the same provider preferences with every request.
        key = (orjson.dumps(prefs, option=orjson.OPT_SORT_KEYS), model, id(cfg.providers))
        found = self._route_cache.get(key)
        if found is None:
            if len(self._route_cache) > 256:
                self._route_cache.clear()
            try:
                found = candidates(cfg.providers, prefs, model)
            except NoEndpoints as exc:
                found = exc
            except TypeError:  # preferences of the wrong shape: treat as none, as the API does
                found = candidates(cfg.providers, None, model)
            self._route_cache[key] = found
        return found

    def _bill(self, r: wire.Reply, key: str, provider: str, latency: float, streamed: bool) -> None:
        st, cost = self._stats, r.usage["cost"]
        st.answers_total += 1
        st.answers_by_provider[provider] = st.answers_by_provider.get(provider, 0) + 1
        fr = r.completion.finish_reason
        st.finish_reasons[fr] = st.finish_reasons.get(fr, 0) + 1
        st.completion_tokens_total += r.usage["completion_tokens"]
        st.billed_usd += cost
        st.prompt_answers[key] = st.prompt_answers.get(key, 0) + 1
        st.prompt_cost[key] = st.prompt_cost.get(key, 0.0) + cost
        gens = self._generations
        # A compact record, not the Reply: up to generation_log_size of these are kept.
        gens[r.gen_id] = (r.provider, r.model, r.created, r.usage["prompt_tokens"], r.usage["completion_tokens"],
                          r.completion.n_reasoning, cost, r.completion.finish_reason, latency, streamed)
        if len(gens) > self._cfg.generation_log_size:
            del gens[next(iter(gens))]

    async def _stream(self, request: web.Request, cfg: SimConfig, r: wire.Reply, ttft: float,
                      latency: float, key: str, provider: str) -> web.StreamResponse:
        resp = await responses.open_stream(request)
        await responses.wait_with_comments(resp, ttft, cfg.processing_comment_s)
        frames = wire.delta_frames(r, self._fragments)
        await responses.paced(resp, frames, max(0.0, latency - ttft))
        self._bill(r, key, provider, latency, streamed=True)
        await resp.write(wire.final_frame(r) + wire.DONE)
        await resp.write_eof()
        return resp

    # -- account endpoints -----------------------------------------------------------------

    async def _credits(self, request: web.Request) -> web.Response:
        cfg = self._cfg
        if (denied := _auth_error(request, cfg)) is not None:
            return denied
        if cfg.credits_forbidden:
            return responses.error(403, "Only management keys can fetch credits")
        return responses.json_response({"data": {"total_credits": cfg.credits,
                                                 "total_usage": self._stats.billed_usd}})

    async def _key(self, request: web.Request) -> web.Response:
        cfg = self._cfg
        if (denied := _auth_error(request, cfg)) is not None:
            return denied
        spent = self._stats.billed_usd
        # The label is fixed: the real one shows part of the key, which must never be echoed.
        return responses.json_response({"data": {
            "label": "draftgen-simulator", "usage": spent, "usage_daily": spent, "usage_weekly": spent,
            "usage_monthly": spent, "limit": cfg.credits, "limit_remaining": cfg.credits - spent,
            "limit_reset": None, "is_free_tier": False, "is_provisioning_key": False,
            "include_byok_in_limit": False,
        }})

    async def _generation(self, request: web.Request) -> web.Response:
        if (denied := _auth_error(request, self._cfg)) is not None:
            return denied
        gen_id = request.query.get("id", "")
        found = self._generations.get(gen_id)
        if found is None:
            return responses.error(404, f"Generation {gen_id!r} not found")
        provider, model, created, prompt, completion, reasoning, cost, finish, latency, streamed = found
        return responses.json_response({"data": {
            "id": gen_id, "upstream_id": f"chatcmpl-{gen_id[4:]}", "total_cost": cost,
            "usage": cost, "cache_discount": None, "created_at": _iso(created), "model": model,
            "app_id": None, "streamed": streamed, "cancelled": False, "provider_name": provider,
            "latency": round(latency * 1000), "generation_time": round(latency * 1000),
            "moderation_latency": None, "finish_reason": finish, "native_finish_reason": finish,
            "tokens_prompt": prompt, "tokens_completion": completion,
            "native_tokens_prompt": prompt, "native_tokens_completion": completion,
            "native_tokens_reasoning": reasoning, "native_tokens_cached": 0,
            "num_media_prompt": None, "num_media_completion": None, "num_search_results": None,
            "origin": "", "is_byok": False,
        }})

    # -- control endpoints (no auth: loopback only, for tests in another process) ----------

    async def _sim_stats(self, request: web.Request) -> web.Response:
        prompts = request.query.get("prompts", "1") not in ("0", "false", "no")
        data = self._stats.to_json(prompts=prompts)
        data["balance"] = self.balance
        return responses.json_response(data)

    async def _sim_get_config(self, request: web.Request) -> web.Response:
        return responses.json_response(self._cfg.to_json())

    async def _sim_post_config(self, request: web.Request) -> web.Response:
        try:
            patch = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return responses.error(400, "POST /_sim/config: body is not JSON")
        if not isinstance(patch, dict):
            return responses.error(400, "POST /_sim/config: body must be a JSON object of SimConfig fields")
        try:
            balance = patch.pop("balance", None)
            if "providers" in patch:
                patch["providers"] = tuple(patch["providers"])
            if patch:
                self.update(**patch)
            if balance is not None:
                self.set_balance(float(balance))
        except (SimulatorError, TypeError, ValueError) as exc:
            return responses.error(400, str(exc))
        return responses.json_response(self._cfg.to_json())


# -- helpers -------------------------------------------------------------------------------


def _auth_error(request: web.Request, cfg: SimConfig) -> web.Response | None:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return responses.error(401, "No auth credentials found")
    if cfg.api_key is not None and key != cfg.api_key:
        return responses.error(401, "User not found." + (f" Key: {key}" if cfg.echo_key else ""))
    return None


def _echo_key(request: web.Request, resp: web.StreamResponse) -> None:
    """SimConfig.echo_key: put the caller's bearer key into an error body (not into answers)."""
    body = getattr(resp, "body", None)
    if not isinstance(body, bytes) or (resp.status < 400 and b'"error"' not in body):
        return
    key = request.headers.get("Authorization", "").partition(" ")[2].strip()
    note = f" (request made with key {key})"
    try:
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(err, dict):
            raise ValueError("no error object")
        err["message"] = f"{err.get('message', '')}{note}"
        meta = err.get("metadata")
        if isinstance(meta, dict):
            meta["raw"] = f"{meta.get('raw', '')}{note}"
        resp.body = orjson.dumps(obj)
    except ValueError:  # orjson.JSONDecodeError included: a plain-text body (524)
        resp.body = body + note.encode()


def _draws(seed: int, key: str, n: int) -> list[float]:
    """Eight uniforms in [0, 1) for the n-th request of a prompt under this seed."""
    digest = hashlib.blake2b(f"{seed}:{key}:{n}".encode(), digest_size=32).digest()
    return [int.from_bytes(digest[i:i + 4], "little") / _U32 for i in range(0, 32, 4)]


def _reasoning_mode(body: dict[str, Any]) -> tuple[bool, bool]:
    """(the model thinks, the reasoning is returned) from `reasoning` / `include_reasoning`."""
    opt = body.get("reasoning")
    if isinstance(opt, dict):
        think = opt.get("enabled", True) is not False and opt.get("effort") != "none"
        return think, think and not opt.get("exclude", False)
    if opt is not None and opt is not False:
        return True, True
    return (True, True) if body.get("include_reasoning") is True else (False, False)


def _last_user_text(messages: list[Any]) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human"):
            content = m.get("content", m.get("value"))
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _latency(cfg: SimConfig, provider: SimProvider, tokens: int, u_jitter: float,
             u_slow: float) -> tuple[float, float]:
    """(total latency, time to first token) in seconds."""
    if cfg.fixed_latency_s is not None:
        return cfg.fixed_latency_s, cfg.fixed_latency_s * 0.2
    if cfg.latency_scale == 0:
        return 0.0, 0.0
    jitter = 1.0 + cfg.jitter * (2.0 * u_jitter - 1.0)
    if u_slow < 0.05:  # a slow replica now and then: the long tail a run really sees
        jitter *= 3.0
    ttft = provider.ttft_s * jitter * cfg.latency_scale
    return ttft + tokens / provider.tokens_per_s * jitter * cfg.latency_scale, ttft


def _iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(ts))


def _misbehave(data: bytes, cfg: SimConfig, prefs: Any) -> bytes:
    """Break an answer the ways a real endpoint has: for showing each smoke check can fail."""
    obj = orjson.loads(data)
    message = obj["choices"][0]["message"]
    usage = obj["usage"]
    for what in cfg.misbehave:
        if what == "no_reasoning":
            message["reasoning"] = None
            message.pop("reasoning_details", None)
            message.pop("reasoning_content", None)
        elif what == "wrong_model":
            obj["model"] = "someone/another-model"
        elif what == "no_cost":
            usage.pop("cost", None)
        elif what == "ignore_routing":
            ignored = (prefs or {}).get("ignore") if isinstance(prefs, dict) else None
            slug = (ignored or ["fireworks"])[0]
            obj["provider"] = next((p.name for p in cfg.providers if p.slug == slug), "Fireworks")
        elif what == "bad_token_count":
            usage["completion_tokens"] += 50
        elif what == "tool_calls":
            message["tool_calls"] = [{"id": "call_0", "type": "function",
                                      "function": {"name": "lookup", "arguments": "{}"}}]
    return orjson.dumps(obj)
