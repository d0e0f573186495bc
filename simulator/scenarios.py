"""Scenarios: every row of OpenRouter's chat-completions table (docs/openrouter.md) as a
named condition the simulator can be switched into, at start (`draftgen simulate --scenario
key_limit:after=30,rate_limited:rate=0.2` or `SimConfig(scenarios={...})`) and at run time
(`POST /_sim/scenario {"name": ..., "on": true, "params": {...}}` or `SimServer.scenario()`).

Parameters every scenario takes:
- `rate`: share of requests (or, for a prompt's own problems, of prompts) it hits; default 1.
- `after`: seconds after switching on before it takes effect; default 0.
- `duration`: seconds it lasts once in effect, then it clears by itself; default: until off.
- `match`: only prompts whose last user message contains this text (all scenarios).
- `after_requests`: only chat requests after the first N the server received (a test's "from the
  N+1th request on", whatever the machine's speed); default 0.
Some take more (see `PARAMS`): `retry_after`, `limit`, `ratio`, `provider`, `midstream`, `what`.

A prompt's own problems (`per_prompt`) are drawn once per prompt, not per request: a retry of a
flagged prompt is flagged again, as on the real service. Everything else is drawn per request.

Who pays (see also faults.py): every response with an error status is decided before any
generation starts and costs nothing; the 200 rows (`finish_error`, `error_body`,
`empty_choices`, `stream_error`) are provider failures and cost nothing either (a choice: the
docs do not say; draftgen must not count on it either way, the generation record says 0).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from draftgen.simulator.errors import SimulatorError


@dataclass(frozen=True)
class Scenario:
    name: str
    status: int  # HTTP status of the response (200 for the answers that carry an error)
    klass: str  # whose problem, as docs/openrouter.md classes it: prompt, transient, dataset, account
    sends: str  # what the simulator sends: the scenario table of docs/simulate.md is made of these
    per_prompt: bool = False


# In the order the service meets them: a request that several scenarios would hit gets the first.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("revoked_key", 401, "account",
             '401 `{"error": {"code": 401, "message": "User not found."}}` on every endpoint'),
    Scenario("payload_too_large", 413, "prompt", "413 `Payload Too Large` for the prompts hit", True),
    Scenario("unknown_model", 404, "dataset", "404 `<model> is not a valid model ID`"),
    Scenario("data_policy", 404, "dataset", "404 `No endpoints found matching your data policy ...`"),
    Scenario("no_allowed_providers", 404, "dataset",
             "404 `No allowed providers are available for the selected model.`"),
    Scenario("no_endpoints_support", 404, "dataset",
             "404 `No endpoints found that support <what>` (param `what`)"),
    Scenario("max_tokens_exceeded", 400, "dataset",
             "every endpoint accepts at most `limit` (default 4096) completion tokens: 400 "
             "`max_tokens_exceeded` when `max_tokens` is above; the endpoints listing shows the limit"),
    Scenario("context_length", 400, "prompt",
             "400 `context_length_exceeded` (`metadata.code`) for the prompts hit", True),
    Scenario("invalid_prompt", 400, "prompt", "400 `invalid_prompt` for the prompts hit", True),
    Scenario("provider_400", 400, "prompt",
             "400 `Provider returned error` with `metadata.provider_name` and `raw` (the provider's own "
             "validation message, no known code) for the prompts hit", True),
    Scenario("bad_parameter", 400, "dataset",
             "400 `Provider returned error` with `metadata.provider_name` and `raw` rejecting a request "
             "parameter (param `what`, default `temperature`), no known code, for every request"),
    Scenario("moderation", 403, "prompt",
             "403 `... requires moderation ... flagged` with `metadata.reasons`, `flagged_input`, "
             "`provider_name`, `model_slug`, for the prompts hit", True),
    Scenario("key_limit", 403, "account",
             "the key's cap is reached (param `limit`, default: the usage when switched on): 403 "
             "`Key limit exceeded (total limit)` with `metadata.limit_source: openrouter_key_limit`, "
             "`limit_usd`, `spend_usd`, `resets_at`, no Retry-After; `GET /key` shows the cap"),
    Scenario("guardrail_budget", 403, "account",
             "403 with `limit_source: openrouter_guardrail_budget`, `limit_usd`, `spend_usd`, `resets_at`"),
    Scenario("workspace_budget", 403, "account",
             "403 with `limit_source: openrouter_workspace_budget`, `limit_usd`, `spend_usd`, `resets_at`"),
    Scenario("out_of_credits", 402, "account",
             "the balance reads 0 (`/credits`, `/key`) and completions get 402 `Insufficient credits`"),
    Scenario("weight_exceeds_budget", 402, "dataset",
             "402 `weight_exceeds_budget` (`limit_source: openrouter_credits`): one request's estimated "
             "cost is above the whole in-flight budget"),
    Scenario("in_flight_budget", 402, "transient",
             "the in-flight spending budget is on (param `ratio` of the balance, default 0.02): running "
             "and recently finished requests' estimated cost fill it, then 402 "
             "`in_flight_budget_exhausted` with `limit_source: openrouter_in_flight_budget` and "
             "Retry-After (a request alone above it gets `weight_exceeds_budget`)"),
    Scenario("rate_limited", 429, "transient",
             "429 with Retry-After and X-RateLimit-Limit/-Remaining/-Reset; param `provider` (share, "
             "default 0.5) adds `metadata.provider_name` and `raw` (the provider's limit)"),
    Scenario("request_timeout", 408, "transient", "408 `Request timed out`"),
    Scenario("no_provider_503", 503, "transient",
             "503 `No available model provider that meets your routing requirements`"),
    Scenario("provider_500", 500, "transient", "500 with `metadata.provider_name`, `raw`"),
    Scenario("provider_502", 502, "transient", "502 `Provider returned error` with `metadata.provider_name`, `raw`"),
    Scenario("gateway_504", 504, "transient", "504 with `metadata.provider_name`, `raw`"),
    Scenario("gateway_524", 524, "transient", "524 with `metadata.provider_name`, `raw` (JSON)"),
    Scenario("error_body", 200, "transient",
             "200 with an `error` object and no `choices` (SSE: an error chunk after some of the answer)"),
    Scenario("finish_error", 200, "transient",
             "200 whose `choices[0].finish_reason` is `error` with `choices[0].error` (SSE: the last chunk)"),
    Scenario("empty_choices", 200, "transient", "200 with `choices: []` (SSE: a chunk with no choices)"),
    Scenario("stream_error", 200, "transient",
             "SSE: part of the answer, then a chunk with a top-level `error` and `finish_reason: "
             "\"error\"`, then the stream ends (plain: as `error_body`)"),
)
BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}

# The scenarios that change the service's state rather than answer requests themselves.
STATEFUL = frozenset({"revoked_key", "key_limit", "out_of_credits", "in_flight_budget", "max_tokens_exceeded"})
# The 5xx and 408 rows can also come as an error chunk of a stream already under way.
MIDSTREAM = frozenset({"request_timeout", "no_provider_503", "provider_500", "provider_502", "gateway_504",
                       "gateway_524"})

COMMON = {"rate": float, "after": float, "duration": float, "match": str, "after_requests": int}
PARAMS: dict[str, dict[str, type]] = {
    "rate_limited": {"retry_after": float, "provider": float},
    "in_flight_budget": {"ratio": float, "window": float, "retry_after": float},
    "key_limit": {"limit": float},
    "guardrail_budget": {"limit": float},
    "workspace_budget": {"limit": float},
    "max_tokens_exceeded": {"limit": int},
    "no_endpoints_support": {"what": str},
    "bad_parameter": {"what": str},
    **{name: {"midstream": bool} for name in MIDSTREAM},
}


@dataclass
class Active:
    """A scenario switched on: in effect from `since` (monotonic) until `until` (None: until off)."""

    scenario: Scenario
    params: dict[str, Any]
    since: float
    until: float | None = None
    hits: int = field(default=0)

    def live(self, now: float) -> bool:
        return self.since <= now and (self.until is None or now < self.until)

    def get(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)

    def applies(self, draw: float, text: str, seq: int = 0) -> bool:
        if seq and seq <= self.params.get("after_requests", 0):
            return False
        match = self.params.get("match")
        if match is not None and match not in text:
            return False
        return draw < self.params.get("rate", 1.0)

    def to_json(self, now: float) -> dict[str, Any]:
        return {"params": self.params, "live": self.live(now), "hits": self.hits,
                "starts_in_s": max(0.0, self.since - now),
                "ends_in_s": None if self.until is None else max(0.0, self.until - now)}


def check_params(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The parameters of scenario `name`, checked and converted; a SimulatorError names a bad one."""
    if name not in BY_NAME:
        raise SimulatorError(f"simulator scenario: unknown {name!r}; known: {', '.join(BY_NAME)}")
    allowed = {**COMMON, **PARAMS.get(name, {})}
    out: dict[str, Any] = {}
    for key, raw in (params or {}).items():
        kind = allowed.get(key)
        if kind is None:
            raise SimulatorError(f"simulator scenario {name}: unknown parameter {key!r}; "
                                 f"known: {', '.join(sorted(allowed))}")
        try:
            if kind is bool:
                value: Any = raw if isinstance(raw, bool) else str(raw).strip().lower() in ("1", "true", "yes", "on")
            else:
                value = kind(raw)
        except (TypeError, ValueError):
            raise SimulatorError(f"simulator scenario {name}: {key} must be a {kind.__name__}, got {raw!r}") from None
        if kind in (int, float) and value < 0:
            raise SimulatorError(f"simulator scenario {name}: {key} must be >= 0, got {raw!r}")
        out[key] = value
    if not 0 <= out.get("rate", 1.0) <= 1:
        raise SimulatorError(f"simulator scenario {name}: rate must be in [0, 1], got {out['rate']!r}")
    return out


def parse_scenarios(spec: str) -> dict[str, dict[str, Any]]:
    """The CLI form `key_limit:after=30,rate_limited:rate=0.2:retry_after=3` as {name: params}."""
    out: dict[str, dict[str, Any]] = {}
    for item in spec.split(","):
        name, *pairs = [p.strip() for p in item.split(":")]
        if not name:
            continue
        params: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise SimulatorError(f"--scenario {item.strip()!r}: {pair!r} is not KEY=VALUE "
                                     "(e.g. rate_limited:rate=0.2:after=10)")
            params[key.strip()] = value.strip()
        out[name.lower()] = check_params(name.lower(), params)
    return out


class Scenarios:
    """The scenarios switched on now."""

    def __init__(self, initial: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._on: dict[str, Active] = {}
        for name, params in (initial or {}).items():
            self.switch(name, True, params)

    def switch(self, name: str, on: bool, params: Mapping[str, Any] | None = None,
               *, on_start: dict[str, Any] | None = None) -> None:
        """Switch `name` on (again, with new params) or off. `on_start` adds defaults the server
        works out when it is switched on (e.g. the key cap: the usage now)."""
        name = str(name).strip().lower()
        checked = check_params(name, params)
        if not on:
            self._on.pop(name, None)
            return
        since = time.monotonic() + checked.get("after", 0.0)
        until = since + checked["duration"] if "duration" in checked else None
        self._on[name] = Active(BY_NAME[name], {**(on_start or {}), **checked}, since, until)

    def clear(self) -> None:
        self._on.clear()

    def live(self, name: str, now: float | None = None) -> Active | None:
        """The scenario `name` if it is on and in effect now."""
        a = self._on.get(name)
        if a is None:
            return None
        now = time.monotonic() if now is None else now
        if a.until is not None and now >= a.until:
            del self._on[name]  # cleared by itself
            return None
        return a if a.live(now) else None

    def first(self, names: tuple[str, ...], request_draw: float, prompt_draw: float, text: str,
              seq: int = 0) -> Active | None:
        """The first of `names` in effect that hits this request (`seq`: its number, from 1)."""
        if not self._on:
            return None
        now = time.monotonic()
        for name in names:
            a = self.live(name, now)
            if a is not None and a.applies(prompt_draw if a.scenario.per_prompt else request_draw, text, seq):
                return a
        return None

    def __bool__(self) -> bool:
        return bool(self._on)

    def to_json(self) -> dict[str, Any]:
        now = time.monotonic()
        for name in list(self._on):
            self.live(name, now)  # drop the ones that ran out
        return {name: a.to_json(now) for name, a in self._on.items()}


# The request-answering scenarios in table order, by where the service meets them.
BEFORE_ROUTING = ("payload_too_large", "unknown_model", "data_policy", "no_allowed_providers", "no_endpoints_support")
PROMPT_CHECKS = ("context_length", "invalid_prompt", "provider_400", "bad_parameter", "moderation")
ACCOUNT_CHECKS = ("guardrail_budget", "workspace_budget", "weight_exceeds_budget")
UPSTREAM = ("rate_limited", "request_timeout", "no_provider_503", "provider_500", "provider_502", "gateway_504",
            "gateway_524")
ANSWER_200 = ("error_body", "finish_error", "empty_choices", "stream_error")
