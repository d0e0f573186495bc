"""What the simulator serves: providers with prices, answer lengths, latency, faults, credits.

`SimConfig` is frozen; `SimServer.update(**changes)` (or `POST /_sim/config`) swaps in a new one
at runtime, so a test can start a 429 storm, empty the credits and top them up again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from draftgen.simulator.errors import SimulatorError
from draftgen.simulator.scenarios import check_params

# Order matters: one uniform draw per request walks these cumulatively, so a given seed and
# prompt always meets the same fault whatever the other rates are set to.
FAULT_KINDS: tuple[str, ...] = (
    "429",            # rate limited, with Retry-After
    "500",
    "502",
    "503",
    "524",            # Cloudflare's origin timeout: a text/plain body, not JSON
    "drop",           # connection closed without any response
    "hang",           # no response for hang_s, then the connection is closed
    "truncated",      # HTTP 200 whose JSON body (or SSE stream) is cut off
    "error200",       # HTTP 200 with an `error` object instead of choices
    "finish_error",   # an answer with finish_reason "error"
    "empty_choices",  # HTTP 200 with `choices: []`
)

_FAULT_ALIASES = {
    "error_body": "error200",
    "200error": "error200",
    "truncate": "truncated",
    "truncated_json": "truncated",
    "empty": "empty_choices",
    "finish-error": "finish_error",
    "empty-choices": "empty_choices",
    "dropped": "drop",
}


MISBEHAVIOURS = ("no_reasoning", "wrong_model", "no_cost", "ignore_routing", "bad_token_count", "tool_calls",
                 "no_usage_chunk", "history_reasoning")

# These shape the answer pool, which is built once when the server starts.
FIXED_AT_START: frozenset[str] = frozenset({"seed", "mean_completion_tokens", "length_sigma", "pool_size"})


@dataclass(frozen=True)
class SimProvider:
    """One upstream endpoint behind the router, as OpenRouter lists it."""

    name: str  # display name, as returned in the response's `provider`
    slug: str  # what `provider.only/ignore/order` name
    quantization: str
    usd_per_m_in: float
    usd_per_m_out: float
    weight: float  # share of traffic when the router load-balances
    ttft_s: float  # time to first token
    tokens_per_s: float
    # Another tokenizer behind this endpoint: the counts it bills (completion and prompt tokens) are
    # this share off the Kimi tokenizer's (0.04: 4 % more), so the validation report and the smoke
    # test can be shown to flag it.
    token_skew: float = 0.0
    # Limits as `GET /models/{author}/{slug}/endpoints` lists them (Kimi-K2.5: 262,144 context).
    max_completion_tokens: int = 262_144
    max_prompt_tokens: int = 262_144
    context_length: int = 262_144


# Kimi-K2.5 endpoints as the reference run met them: int4 providers serve the model's tokens,
# Fireworks and Baseten serve FP4 variants (which the reference config ignores).
# DeepInfra's price reproduces the product's reference smoke check: 205 completion tokens cost ~$0.00047.
DEFAULT_PROVIDERS: tuple[SimProvider, ...] = (
    SimProvider("DeepInfra", "deepinfra", "int4", 0.45, 2.25, 3.0, 0.9, 38.0),
    SimProvider("Together", "together", "int4", 0.60, 3.00, 3.0, 0.6, 55.0),
    SimProvider("Parasail", "parasail", "int4", 0.55, 2.80, 2.0, 0.8, 45.0),
    SimProvider("AtlasCloud", "atlas-cloud", "int4", 0.50, 2.50, 1.0, 1.2, 30.0),
    SimProvider("Fireworks", "fireworks", "fp4", 0.60, 2.50, 2.0, 0.4, 90.0),
    SimProvider("Baseten", "baseten", "fp4", 0.60, 2.50, 1.0, 0.5, 80.0),
)


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator does; every field can be patched at runtime except those in
    `FIXED_AT_START`."""

    seed: int = 0
    # Answers: lengths are log-normal around this mean (reasoning + content + 2 special tokens).
    mean_completion_tokens: int = 1200
    length_sigma: float = 0.6
    pool_size: int = 192
    # None accepts any non-empty bearer key; a string requires exactly that key (never printed).
    api_key: str | None = field(default=None, repr=False)
    # Credits: total purchased; the balance is credits - spent. 402 when it cannot pay.
    credits: float = 100.0
    credits_forbidden: bool = False  # /credits answers 403 to every key
    # Keys that may read `GET /credits` (OpenRouter's management keys); any other key gets 403
    # there. None: every accepted key may (the simulator's old default, kept for the suite).
    management_keys: tuple[str, ...] | None = field(default=None, repr=False)
    # The key's own spending cap (`GET /key` data.limit); null: no cap. Reached: 403 with
    # `limit_source: openrouter_key_limit`. Raise it (POST /_sim/config) to recover.
    key_limit_usd: float | None = None
    key_limit_reset: str | None = None  # "daily", "weekly", "monthly" or None, as /key shows it
    # In-flight spending budget: running plus recently finished (within in_flight_window_s)
    # requests' estimated cost may not exceed this share of the balance. None: off.
    in_flight_budget_ratio: float | None = None
    in_flight_window_s: float = 2.0
    # Model ids served (`GET /models`; any other gets 404). None: any id is served as asked.
    models: tuple[str, ...] | None = None
    # Seconds after a generation ends before `GET /generation?id=` finds it (404 before).
    generation_delay_s: float = 0.0
    # Scenarios switched on at start: {name: {param: value}} (see scenarios.py).
    scenarios: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Latency = (ttft + tokens / tokens_per_s) * jitter * latency_scale, or fixed_latency_s.
    latency_scale: float = 1.0
    fixed_latency_s: float | None = None
    # Hold every request until this many are in flight at once (or hold_timeout_s passes): shows
    # a client really reaches a concurrency however slowly a loaded machine admits requests.
    hold_until_in_flight: int | None = None
    hold_timeout_s: float = 60.0
    jitter: float = 0.35
    # Faults: kind -> probability per request (see FAULT_KINDS); at most 1.0 in all.
    faults: Mapping[str, float] = field(default_factory=dict)
    retry_after_s: float = 1.0
    hang_s: float = 600.0
    # Requests beyond this many in flight get 429, like a provider's concurrency limit.
    max_in_flight: int | None = None
    # Chance that the first choice of the router is "down" and the next provider serves.
    fallback_rate: float = 0.1
    # Chance that the billed completion_tokens is off by one from the answer's real count.
    tokens_drift: float = 0.0
    # A provider that runs past max_tokens: it generates (and bills) up to this many tokens more than the
    # request's max_tokens allows (0: every provider honours max_tokens). Only the providers named in
    # past_max_tokens_providers do (empty: all of them).
    past_max_tokens: int = 0
    past_max_tokens_providers: tuple[str, ...] = ()
    # Per model id, a factor on the prices its endpoints listing shows (fallback models that cost more).
    model_price_factor: Mapping[str, float] = field(default_factory=dict)
    # The system turn the simulated servers render in front of a conversation that has none, counted
    # in usage.prompt_tokens: None as Kimi-K2.5's chat template does; a text to play a server that
    # renders another prompt than the run reconstructs (the prompt check then fails).
    default_system: str | None = None
    # Play a server without ids (SGLang 0.5.16 and earlier): `return_token_ids` is ignored without a word.
    ignore_token_ids: bool = False
    # Where the reasoning goes: OpenRouter uses `reasoning`; vLLM/SGLang use `reasoning_content`.
    reasoning_field: Literal["reasoning", "reasoning_content"] = "reasoning"
    # SSE keep-alive comment while the first token is awaited.
    processing_comment_s: float = 2.0
    # Tokens per SSE delta of a streamed answer (OpenRouter sends one event per few tokens).
    stream_chunk_tokens: int = 12
    providers: tuple[SimProvider, ...] = DEFAULT_PROVIDERS
    # Deliberate wire-level misbehaviour, so the smoke test's checks can be shown to fail
    # (non-streamed answers; on streams, no_cost and no_usage_chunk: a stream closed after its
    # finish_reason chunk, before the usage chunk and [DONE]): see MISBEHAVIOURS. history_reasoning:
    # usage.prompt_tokens counts the reasoning of earlier assistant turns (a server whose template keeps
    # it in the history), so a multi-turn prompt check agrees at turn 1 and fails from turn 2 on.
    misbehave: tuple[str, ...] = ()
    # A router or server that answers as another model: every answer's `model` (streamed or not) and its
    # generation record name this one ("" answers as the model asked).
    answer_model: str = ""
    # A careless upstream: error bodies (4xx/5xx, and 200s carrying an error) quote the bearer key
    # the request came with, so tests can show draftgen never writes or prints what it is sent.
    echo_key: bool = False
    # A careless upstream that echoes the key beyond its error text: in every answer's X-Generation-Id
    # header and `id`, its `provider` and `model` fields (plain), and, with echo_key, in error messages
    # and metadata JSON-\u-escaped, percent-encoded (both cases) and in base64 (a Basic credential).
    echo_key_fields: bool = False
    # A hostile upstream: this text (escape sequences, say) in every answer's `provider`, `id` and `model` (as its
    # `:variant`, so the model is still the one asked),
    # at the start of its content and reasoning, in every error's message and metadata (mid-stream error
    # frames included) and in the key's label, so tests can show no view or log passes it on raw.
    hostile_text: str = ""
    # How many generations `/generation?id=` remembers (oldest forgotten first).
    generation_log_size: int = 100_000
    # How many of the latest chat requests `SimServer.sent` (and `GET /_sim/sent`) keep, with the
    # messages each was sent and the prompt tokens it counted: 0 keeps none (a long run's bodies stay
    # out of memory). Lets a test check what every request carried, e.g. that each multi-turn history
    # holds the target's own earlier answers.
    sent_log_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", normalise_faults(self.faults))
        object.__setattr__(self, "providers", tuple(_provider(p) for p in self.providers))
        _check(self.mean_completion_tokens >= 8, "mean_completion_tokens", "must be at least 8")
        _check(self.pool_size >= 1, "pool_size", "must be at least 1")
        _check(self.length_sigma >= 0, "length_sigma", "must be >= 0")
        _check(math.isfinite(self.credits), "credits", "must be a finite number")
        _check(self.latency_scale >= 0, "latency_scale", "must be >= 0")
        _check(self.fixed_latency_s is None or self.fixed_latency_s >= 0, "fixed_latency_s", "must be >= 0")
        _check(0 <= self.jitter < 1, "jitter", "must be in [0, 1)")
        _check(self.retry_after_s >= 0, "retry_after_s", "must be >= 0")
        _check(self.hang_s >= 0, "hang_s", "must be >= 0")
        _check(self.max_in_flight is None or self.max_in_flight >= 1, "max_in_flight", "must be >= 1")
        _check(0 <= self.fallback_rate <= 1, "fallback_rate", "must be in [0, 1]")
        _check(0 <= self.tokens_drift <= 1, "tokens_drift", "must be in [0, 1]")
        _check(self.past_max_tokens >= 0, "past_max_tokens", "must be >= 0")
        object.__setattr__(self, "past_max_tokens_providers", tuple(self.past_max_tokens_providers))
        object.__setattr__(self, "model_price_factor", {str(k): float(v) for k, v in self.model_price_factor.items()})
        _check(all(v > 0 for v in self.model_price_factor.values()), "model_price_factor", "factors must be > 0")
        _check(self.reasoning_field in ("reasoning", "reasoning_content"), "reasoning_field",
               "must be 'reasoning' or 'reasoning_content'")
        _check(self.processing_comment_s > 0, "processing_comment_s", "must be > 0")
        _check(self.stream_chunk_tokens >= 1, "stream_chunk_tokens", "must be at least 1")
        _check(len(self.providers) >= 1, "providers", "needs at least one provider")
        _check(all(-0.5 <= p.token_skew <= 1 for p in self.providers), "providers", "token_skew must be in [-0.5, 1]")
        object.__setattr__(self, "misbehave", tuple(self.misbehave))
        _check(all(m in MISBEHAVIOURS for m in self.misbehave), "misbehave",
               f"must name some of {', '.join(MISBEHAVIOURS)}")
        _check(self.generation_log_size >= 1, "generation_log_size", "must be >= 1")
        _check(self.sent_log_size >= 0, "sent_log_size", "must be >= 0")
        if self.management_keys is not None:
            object.__setattr__(self, "management_keys", tuple(self.management_keys))
        if self.models is not None:
            object.__setattr__(self, "models", tuple(self.models))
        _check(self.key_limit_usd is None or self.key_limit_usd >= 0, "key_limit_usd", "must be >= 0 or null")
        _check(self.in_flight_budget_ratio is None or self.in_flight_budget_ratio > 0, "in_flight_budget_ratio",
               "must be > 0 or null")
        _check(self.in_flight_window_s >= 0, "in_flight_window_s", "must be >= 0")
        _check(self.generation_delay_s >= 0, "generation_delay_s", "must be >= 0")
        object.__setattr__(self, "scenarios", {str(k).lower(): check_params(str(k).lower(), v)
                                               for k, v in (self.scenarios or {}).items()})

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with `changes`; unknown field names are a SimulatorError naming them."""
        known = {f.name for f in dataclasses.fields(self) if f.init}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise SimulatorError(f"simulator config: unknown field(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
        try:
            return dataclasses.replace(self, **changes)
        except (TypeError, ValueError) as exc:
            raise SimulatorError(f"simulator config: bad value for {', '.join(sorted(changes))}: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["faults"] = dict(self.faults)
        out["model_price_factor"] = dict(self.model_price_factor)
        out["providers"] = [dataclasses.asdict(p) for p in self.providers]
        out["api_key"] = None if self.api_key is None else "(set)"  # never echo a key
        out["management_keys"] = None if self.management_keys is None else len(self.management_keys)
        out["scenarios"] = {k: dict(v) for k, v in self.scenarios.items()}
        return out


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise SimulatorError(f"simulator config: {name} {what}")


def _provider(p: SimProvider | Mapping[str, Any]) -> SimProvider:
    if isinstance(p, SimProvider):
        return p
    try:
        return SimProvider(**p)
    except TypeError as exc:
        raise SimulatorError(f"simulator config: providers: bad entry {dict(p)!r}: {exc}") from exc


def normalise_faults(faults: Mapping[str, float] | None) -> dict[str, float]:
    """Canonical kind names, rates checked in [0, 1] and summing to at most 1."""
    out: dict[str, float] = {}
    for raw_kind, raw_rate in (faults or {}).items():
        kind = _FAULT_ALIASES.get(str(raw_kind).strip().lower(), str(raw_kind).strip().lower())
        if kind not in FAULT_KINDS:
            raise SimulatorError(f"simulator faults: unknown kind {raw_kind!r}; "
                                 f"known: {', '.join(FAULT_KINDS)}")
        try:
            rate = float(raw_rate)
        except (TypeError, ValueError):
            raise SimulatorError(f"simulator faults: rate of {raw_kind!r} is not a number: {raw_rate!r}") from None
        if not 0.0 <= rate <= 1.0:
            raise SimulatorError(f"simulator faults: rate of {raw_kind!r} must be in [0, 1], got {rate}")
        if rate > 0:
            out[kind] = out.get(kind, 0.0) + rate
    total = sum(out.values())
    if total > 1.0 + 1e-9:
        raise SimulatorError(f"simulator faults: rates add up to {total:g}, more than 1")
    return out


def parse_faults(spec: str) -> dict[str, float]:
    """The CLI form `429=0.3,500=0.1,drop=0.05` as a checked {kind: rate} dict."""
    pairs: dict[str, float] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        kind, sep, rate = item.partition("=")
        if not sep:
            raise SimulatorError(f"--faults: {item!r} is not KIND=RATE (e.g. 429=0.3,drop=0.05)")
        try:
            pairs[kind.strip()] = pairs.get(kind.strip(), 0.0) + float(rate)
        except ValueError:
            raise SimulatorError(f"--faults: rate of {kind.strip()!r} is not a number: {rate.strip()!r}") from None
    return normalise_faults(pairs)
