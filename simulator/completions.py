"""POST /api/v1/chat/completions: the checks in the order the service makes them, then an answer
(plain JSON or SSE), a fault (faults.py) or a scenario's response (scenarios.py).

Order: key (401) -> body (400) -> model and routing (404) -> max_tokens against the endpoints
(400 max_tokens_exceeded) -> the prompt's own problems (400 context length / invalid prompt,
403 moderation) -> the account (403 key cap and budgets, 402 balance and in-flight budget) ->
upstream (429, 408, 5xx) -> the generation. Everything before the generation is free; the
generation is billed by `Generations` (generations.py), whoever is still listening.

Every response to a completion carries `X-Generation-Id` (sent with the headers, so a stream's
id is known at once), the same id as the body's `id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from draftgen.simulator import responses, scenarios, shaping, wire
from draftgen.simulator.account import Account, auth_error
from draftgen.simulator.answer_text import style_of_prompt
from draftgen.simulator.answers import AnswerPool, answer_tokenizer
from draftgen.simulator.config import SimConfig, SimProvider
from draftgen.simulator.faults import pick_fault, serve_fault
from draftgen.simulator.generations import Generation, Generations
from draftgen.simulator.models import Models, completion_limit
from draftgen.simulator.prompt import prompt_token_count
from draftgen.simulator.routing import NoEndpoints, candidates, choose
from draftgen.simulator.scenarios import Active, Scenarios
from draftgen.simulator.stats import Sent, SimStats
from draftgen.simulator.tools import calls_ids, tool_calls

# The generation a request started, so that a stream the client aborts is billed up to there.
GENERATION = web.RequestKey("draftgen_sim_generation", Generation)   # started: billed
CREATED = web.RequestKey("draftgen_sim_created", Generation)         # its id given out, maybe never started
SEQ = web.RequestKey("draftgen_sim_seq", int)                         # the chat request's number, from 1
# The 200-with-a-problem scenarios as the fault that draws the same response.
_AS_FAULT = {"error_body": "error200", "finish_error": "finish_error", "empty_choices": "empty_choices",
             "stream_error": "error200"}



@dataclass(slots=True)
class _Ask:
    """One chat request as the checks read it, filled in as it passes them (provider once routed)."""
    body: dict[str, Any]
    messages: Any
    model: Any
    max_tokens: int | None
    stream: bool
    prefs: Any
    key: str        # the prompt's key: its messages' hash
    n: int          # how many times this prompt was asked, this try included
    draws: list[float]
    prompt_draw: float
    text: str       # the last user message (what scenarios match on)
    seq: int        # the chat request's number, from 1
    provider: SimProvider = field(init=False)  # set by _route, before any later check reads it
    limit: int = 0
    n_prompt: int = 0
    context: int = 0
    estimate: float = 0.0


class Completions:
    def __init__(self, stats: SimStats, config: Callable[[], SimConfig], pool: Callable[[], AnswerPool],
                 scenarios: Scenarios, account: Account, generations: Generations, models: Models) -> None:
        self._stats = stats
        self._config = config
        self._pool = pool
        self._scenarios = scenarios
        self._account = account
        self._generations = generations
        self._models = models
        self._gen_counter = 0
        self.fragments: wire.FragmentCache = {}
        self._memo = Memo()
        self._held = asyncio.Event()
        self.sent: deque[Sent] = deque(maxlen=0)  # SimConfig.sent_log_size; see SimServer.sent

    def forget_routes(self) -> None:
        self._memo.forget_routes()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        st = self._stats
        st.requests_total += 1
        request[SEQ] = st.requests_total
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
        status = "?"
        cfg = self._config()
        try:
            if cfg.hold_until_in_flight is not None:
                await self._hold(cfg)
            resp = await self._serve(request, cfg)
            status = str(resp.status)
            if responses.GEN_ID in request and not resp.prepared:
                resp.headers["X-Generation-Id"] = request[responses.GEN_ID]
            if cfg.echo_key:
                shaping.echo_key(request, resp, encoded=cfg.echo_key_fields)
            shaping.hostile_error(resp, cfg.hostile_text)
            return resp
        except asyncio.CancelledError:
            status = request.get(responses.NO_RESPONSE, "cancelled")
            self._abandoned(request)
            raise
        except ConnectionError:
            # The client left mid-stream before aiohttp noticed; a stand-in response lets aiohttp
            # see the closed connection itself instead of logging a handler error.
            status = "cancelled"
            self._abandoned(request)
            return web.Response(status=499)
        finally:
            st.in_flight -= 1
            st.by_status[status] = st.by_status.get(status, 0) + 1

    async def _hold(self, cfg: SimConfig) -> None:
        until = cfg.hold_until_in_flight
        if until is not None and self._stats.in_flight >= until:
            self._held.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._held.wait(), cfg.hold_timeout_s)

    def _abandoned(self, request: web.Request) -> None:
        """The client left: a stream stops (billed so far); a plain request runs on to its bill. A
        generation that never started (an error inside a 200 under way) gets its zero-cost record."""
        g = request.get(GENERATION)
        if g is not None:
            self._generations.abandoned(g)
        elif (created := request.get(CREATED)) is not None:
            self._generations.failed(created)

    def _hit(self, a: Active | str) -> None:
        """Count a response a scenario sent (on the scenario and in the stats)."""
        active = self._scenarios.live(a) if isinstance(a, str) else a
        if active is None:
            return
        active.hits += 1
        name = active.scenario.name
        self._stats.scenarios[name] = self._stats.scenarios.get(name, 0) + 1

    def _new_id(self, key: str, n: int, echo: str = "") -> str:
        """A generation id; `echo` (SimConfig.echo_key_fields: the caller's key) is put in it."""
        self._gen_counter += 1
        return f"gen-{int(time.time())}-{key[:8]}{n:x}{self._gen_counter:x}" + (f"-{echo}" if echo else "")

    async def _serve(self, request: web.Request, cfg: SimConfig) -> web.StreamResponse:
        """One chat completion, checked as OpenRouter checks it: the key, the body, routing and the
        prompt, the account; then an upstream error, a fault, or the answer (streamed or whole)."""
        if (denied := auth_error(request, cfg, self._scenarios)) is not None:
            self._hit("revoked_key")
            return denied
        body = await read_body(request)
        if isinstance(body, web.Response):
            return body
        ask = self._ask(body, cfg, request.get(SEQ, 0))
        # (A response is a mapping, falsy when empty: each refusal is told by `is not None`.)
        refused = self._route(ask, cfg)
        self._log_sent(ask, cfg)
        if refused is not None:
            return refused
        if (refused := self._check_prompt(ask)) is not None:
            return refused
        if (refused := self._check_account(ask, cfg)) is not None:
            return refused
        upstream = self._first(ask, scenarios.UPSTREAM)
        if upstream is not None and not (ask.stream and upstream.get("midstream")):
            self._hit(upstream)
            return upstream_error(upstream, ask.provider, ask.draws[5], cfg)
        gen, reply = self._generate(request, ask, cfg)
        if upstream is not None:  # a 5xx of a stream already under way: an error chunk, nothing billed
            return await self._midstream_error(request, cfg, upstream, gen, reply)
        answer_200 = self._first(ask, scenarios.ANSWER_200)
        fault = _AS_FAULT[answer_200.scenario.name] if answer_200 is not None else pick_fault(cfg.faults, ask.draws[2])
        if answer_200 is not None:
            self._hit(answer_200)
        elif fault is not None:
            self._stats.faults[fault] = self._stats.faults.get(fault, 0) + 1
        if fault is not None:
            return await serve_fault(request, cfg, fault, reply, gen.ttft, gen.latency, ask.stream, self.fragments,
                                     lambda: self._start(request, gen), self._generations.finish,
                                     lambda: self._generations.failed(gen))
        self._start(request, gen)
        if ask.stream:
            return await self._stream(request, cfg, reply, gen)
        if gen.latency > 0:
            await asyncio.sleep(gen.latency)
        self._generations.finish(gen)
        self._delivered(reply)
        data = wire.completion_json(reply, self.fragments)
        if cfg.misbehave:
            data = shaping.misbehave(data, cfg, ask.prefs)
        return web.Response(body=data, content_type=responses.JSON)

    def _ask(self, body: dict[str, Any], cfg: SimConfig, seq: int) -> _Ask:
        """The request's fields, its prompt's key and how many times that prompt was asked, and the
        random draws of this try (a prompt's own problems draw the same for every retry of it)."""
        sc, st = self._scenarios, self._stats
        messages = body["messages"]
        key = hashlib.sha1(orjson.dumps(messages)).hexdigest()
        n = st.prompt_requests.get(key, 0) + 1
        st.prompt_requests[key] = n
        return _Ask(body=body, messages=messages, model=body["model"],
                    max_tokens=body.get("max_tokens", body.get("max_completion_tokens")),
                    stream=bool(body.get("stream")), prefs=body.get("provider"), key=key, n=n,
                    draws=shaping.draws(cfg.seed, key, n),
                    prompt_draw=shaping.draws(cfg.seed, key, 0)[3] if sc else 1.0,
                    text=shaping.last_user_text(messages) if sc else "", seq=seq)

    def _log_sent(self, ask: _Ask, cfg: SimConfig) -> None:
        if cfg.sent_log_size:
            if self.sent.maxlen != cfg.sent_log_size:
                self.sent = deque(self.sent, maxlen=cfg.sent_log_size)
            self.sent.append(Sent(ask.seq, ask.messages, ask.n_prompt, ask.body.get("tools")))

    def _first(self, ask: _Ask, stage: tuple[str, ...]) -> Active | None:
        """The first scenario of `stage` this try draws (None without scenarios)."""
        sc = self._scenarios
        return sc.first(stage, ask.draws[3], ask.prompt_draw, ask.text, ask.seq) if sc else None

    def _route(self, ask: _Ask, cfg: SimConfig) -> web.Response | None:
        """Pick the provider, or refuse: no endpoint for the model or the preferences, max_tokens over
        every endpoint's limit, a prompt over the context."""
        sc, model = self._scenarios, ask.model
        if (a := self._first(ask, scenarios.BEFORE_ROUTING)) is not None:
            self._hit(a)
            if a.scenario.name == "payload_too_large":
                return responses.error(413, "Payload Too Large: the request body is larger than this endpoint "
                                            "accepts")
            return responses.no_endpoints(a.scenario.name, model, a.get("what", "the requested parameters"))
        if not self._models.known(model):
            return responses.no_endpoints("unknown_model", model)
        routes = self._memo.routes(cfg, ask.prefs, model)
        if isinstance(routes, NoEndpoints):
            return responses.error(404, routes.message)
        provider = ask.provider = choose(routes, ask.prefs, ask.draws[0], ask.draws[1], cfg.fallback_rate)
        limit = ask.limit = max(completion_limit(p, sc) if sc else p.max_completion_tokens for p in routes)
        max_tokens = ask.max_tokens
        if max_tokens is not None and max_tokens > limit:
            self._hit("max_tokens_exceeded")
            return responses.error(400, f"max_tokens_exceeded: max_tokens ({max_tokens}) is more than any "
                                        f"allowed endpoint accepts ({limit})", {"code": "max_tokens_exceeded"})
        n_prompt = self._memo.prompt_tokens(ask.key, ask.messages, cfg.default_system,
                                            "history_reasoning" in cfg.misbehave, ask.body.get("tools"))
        if provider.token_skew:  # another tokenizer behind this endpoint: it bills other counts
            n_prompt = max(1, round(n_prompt * (1 + provider.token_skew)))
        ask.n_prompt = n_prompt
        ask.context = max(p.context_length for p in routes)
        if n_prompt + (max_tokens or 0) > ask.context:
            return responses.prompt_400("context_length", model, n_prompt, ask.context, max_tokens)
        return None

    def _check_prompt(self, ask: _Ask) -> web.Response | None:
        """A prompt the provider refuses: moderation, a parameter it rejects, a prompt-shaped 400."""
        a = self._first(ask, scenarios.PROMPT_CHECKS)
        if a is None:
            return None
        self._hit(a)
        if a.scenario.name == "moderation":
            return responses.moderation(ask.provider.name, ask.model, ask.text)
        if a.scenario.name in ("provider_400", "bad_parameter"):
            return responses.provider_400(a.scenario.name, ask.provider.name, a.get("what", "temperature"))
        return responses.prompt_400(a.scenario.name, ask.model, ask.n_prompt, ask.context, ask.max_tokens)

    def _check_account(self, ask: _Ask, cfg: SimConfig) -> web.Response | None:
        """What the account refuses: the key's limit, a budget, no credits, credits short of max_tokens,
        the in-flight budget, too many requests at once."""
        if (capped := self._account.key_limited()) is not None:
            self._hit("key_limit")
            return capped
        provider, max_tokens = ask.provider, ask.max_tokens
        est_tokens = min(max_tokens or ask.limit, ask.limit)
        estimate = ask.estimate = (ask.n_prompt * provider.usd_per_m_in + est_tokens * provider.usd_per_m_out) / 1e6
        if (a := self._first(ask, scenarios.ACCOUNT_CHECKS)) is not None:
            self._hit(a)
            if a.scenario.name == "weight_exceeds_budget":
                return responses.weight_exceeds(estimate / 2, estimate)
            return self._account.other_budget(a)
        balance = self._account.balance()
        if balance <= 0:
            self._hit("out_of_credits")
            return responses.out_of_credits()
        affordable = int(balance / (provider.usd_per_m_out / 1e6)) if provider.usd_per_m_out > 0 else 1 << 62
        if max_tokens is not None and affordable < max_tokens:
            return responses.error(402, "This request requires more credits, or fewer max_tokens. You requested "
                                        f"up to {max_tokens} tokens, but can only afford {affordable}. To increase, "
                                        "visit https://openrouter.ai/settings/credits and add more credits")
        if (full := self._account.admit(estimate)) is not None:
            self._hit("in_flight_budget")
            return full
        st = self._stats
        if cfg.max_in_flight is not None and st.in_flight > cfg.max_in_flight:
            st.faults["max_in_flight"] = st.faults.get("max_in_flight", 0) + 1
            return responses.rate_limited(cfg, ask.provider.name)
        return None

    def _generate(self, request: web.Request, ask: _Ask, cfg: SimConfig) -> tuple[Generation, wire.Reply]:
        """The answer (it depends on the seed and the prompt only: a retry gets the same text), what it
        bills, its timing and its generation id, given out on the request."""
        provider, draws = ask.provider, ask.draws
        think, show = shaping.reasoning_mode(ask.body)
        pool = self._pool()
        answer = pool.pick(style_of_prompt(shaping.last_user_text(ask.messages)),
                           int(ask.key[:15], 16) + cfg.seed * 0x9E3779B97F4A7C15)
        cap = ask.max_tokens
        over = cfg.past_max_tokens if cap is not None and (
            not cfg.past_max_tokens_providers or provider.name in cfg.past_max_tokens_providers) else 0
        # A provider past max_tokens generates (and bills) more than the request allows.
        completion = pool.complete(answer, cap + over if cap is not None and over else cap, think)
        billed_tokens = completion.completion_tokens
        # `tools` sent: the step's planned calls (tools.py) instead of the content, when the answer was not cut.
        calls = tool_calls(ask.messages, ask.body.get("tools")) if completion.finish_reason == "stop" else []
        call_ids = calls_ids(answer_tokenizer(), calls) if calls else []
        if calls:
            billed_tokens = completion.n_reasoning + completion.think_end + len(call_ids) + 1
        if draws[4] < cfg.tokens_drift:
            billed_tokens = max(1, billed_tokens + (1 if draws[5] < 0.5 else -1))
        if provider.token_skew:
            billed_tokens = max(1, round(billed_tokens * (1 + provider.token_skew)))
        latency, ttft = shaping.latency(cfg, provider, completion.completion_tokens, draws[6], draws[7])
        echo = shaping.bearer_key(request) if cfg.echo_key_fields else ""
        model = cfg.answer_model or ask.model
        gen = Generation(self._new_id(ask.key, ask.n, echo), ask.key, provider, model, int(time.time()),
                         ask.n_prompt, completion, billed_tokens, ask.stream, ttft, latency, ask.estimate)
        request[responses.GEN_ID] = gen.gen_id
        request[CREATED] = gen
        # echo_key_fields: the key in the answer's `provider` and `model` too (the model still starts with
        # the one asked for, as a provider's variant name does).
        # hostile_text: in the body's `id` (a header carries no control character), `provider` and `model` (as
        # its variant, after a colon: the model is still the one asked, so the run is not held for another's).
        hostile = cfg.hostile_text
        reply = wire.Reply(gen.gen_id + hostile, (f"{provider.name} [{echo}]" if echo else provider.name) + hostile,
                           f"{model}:{echo}{hostile}" if echo or hostile else model, gen.created, completion,
                           think and show, cfg.reasoning_field,
                           ask.body.get("return_token_ids") is True and not cfg.ignore_token_ids,
                           wire.usage(ask.n_prompt, billed_tokens, completion.n_reasoning, gen.full_cost),
                           cfg.stream_chunk_tokens, echo, hostile, tuple(calls), tuple(call_ids))
        return gen, reply

    async def _midstream_error(self, request: web.Request, cfg: SimConfig, upstream: Active, gen: Generation,
                               reply: wire.Reply) -> web.StreamResponse:
        """A 5xx of a stream already under way: an error chunk after the first wait, nothing billed."""
        self._hit(upstream)
        code = upstream.scenario.status
        message, meta = responses.upstream(code, gen.provider.name)
        resp = await responses.open_stream(request)
        await responses.wait_with_comments(resp, gen.ttft, cfg.processing_comment_s)
        await resp.write(wire.error_frame(reply, code, message, meta))
        await resp.write_eof()
        self._generations.failed(gen)
        return resp

    def _start(self, request: web.Request, gen: Generation) -> Generation:
        request[GENERATION] = gen
        self._account.started(gen)
        self._generations.start(gen)
        return gen

    def _delivered(self, r: wire.Reply) -> None:
        st = self._stats
        st.answers_total += 1
        st.answers_by_provider[r.provider] = st.answers_by_provider.get(r.provider, 0) + 1
        fr = r.completion.finish_reason
        st.finish_reasons[fr] = st.finish_reasons.get(fr, 0) + 1

    async def _stream(self, request: web.Request, cfg: SimConfig, r: wire.Reply,
                      gen: Generation) -> web.StreamResponse:
        resp = await responses.open_stream(request)
        await responses.wait_with_comments(resp, gen.ttft, cfg.processing_comment_s)
        frames = wire.delta_frames(r, self.fragments)
        await responses.paced(resp, frames, max(0.0, gen.latency - gen.ttft))
        self._generations.finish(gen)
        self._delivered(r)
        await resp.write(shaping.stream_end(r, cfg) if cfg.misbehave else wire.final_frame(r) + wire.DONE)
        await resp.write_eof()
        return resp


async def read_body(request: web.Request) -> dict[str, Any] | web.Response:
    """The request body, or the 400 the API answers a malformed one with."""
    try:
        body = orjson.loads(await request.read())
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
    return body


def upstream_error(a: Active, provider: SimProvider, draw: float, cfg: SimConfig) -> web.Response:
    """A provider's or the gateway's error status (429 by the provider or by OpenRouter, 5xx)."""
    code = a.scenario.status
    if code == 429:
        by_provider = draw < a.get("provider", 0.5)
        return responses.rate_limited_by(provider.name if by_provider else None,
                                         a.get("retry_after", cfg.retry_after_s))
    message, meta = responses.upstream(code, provider.name)
    return responses.error(code, message, meta)


class Memo:
    """What the simulator works out once per prompt or per routing preferences: a run sends the same
    provider preferences with every request, and retries and repeated prompts the same messages."""

    def __init__(self) -> None:
        self._route_cache: dict[tuple[bytes, str, int], list[SimProvider] | NoEndpoints] = {}
        self._prompt_cache: dict[tuple[str, str | None, bool], int] = {}

    def forget_routes(self) -> None:
        self._route_cache.clear()

    def prompt_tokens(self, key: str, messages: list[Any], system: str | None, history_reasoning: bool = False,
                      tools: Any = None) -> int:
        # Memoised per prompt (and its tools): retries and repeated prompts are not tokenized again.
        memo = (key + hashlib.sha1(orjson.dumps(tools)).hexdigest() if tools else key, system, history_reasoning)
        found = self._prompt_cache.get(memo)
        if found is None:
            if len(self._prompt_cache) > 65536:
                self._prompt_cache.clear()
            found = self._prompt_cache[memo] = prompt_token_count(
                answer_tokenizer(), messages, system, keep_history_reasoning=history_reasoning, tools=tools)
        return found

    def routes(self, cfg: SimConfig, prefs: Any, model: str) -> list[SimProvider] | NoEndpoints:
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
