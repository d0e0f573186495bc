"""What a request can cost at worst: prices per token at the most expensive provider a dataset's
routing allows, and the worst-case cost of one request.

Prices come from OpenRouter's `GET /api/v1/models/{author}/{slug}/endpoints` (`data.endpoints[]`,
one per provider: `provider_name`, `tag`, `quantization`, `pricing.prompt` / `pricing.completion` /
`pricing.request` in USD per token or per request, as strings), filtered by the dataset's
`provider` routing (`ignore`, `only`, `quantizations`): with `allow_fallbacks` any allowed endpoint
may serve a request, so the worst case takes the highest prompt and the highest completion price
among them. A body with fallback models (`models = [...]`, OpenRouter's `route = "fallback"`) may be
served by any of them: each one's listing is read and the worst case takes the highest prices over
every model and endpoint the routing allows. `[api] prompt_price_per_mtok` / `completion_price_per_mtok`
set the prices for servers without that listing (and win over it when set).

A listing is not trusted when it prices a dataset at $0 (prompt and completion) on OpenRouter for a
model that is not free (OpenRouter's free variants have ids ending in ":free"): a model that stopped
being free, or a wrong listing, would make every reservation $0. Such a dataset is unpriced, so with
`max_usd` the run refuses to start until `[api]` prices are set (`require_prices`). Prices below what
providers bill are found out by the bills themselves (core/generate/money/trust.py).

The worst case is read from the body actually sent: its largest answer cap (`max_tokens` and its other
names, a reasoning budget), times the answers it asks for (`n`, `best_of`; the load refuses more than
one, the reservation still counts them).

Prompt tokens are bounded without the tokenizer (the engine does not load it; reconstruction runs
in worker processes): every token of a byte-level BPE covers at least one byte, so the UTF-8 bytes
of the messages plus a few tokens per message for the chat template never undercount.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from draftgen.core.bodies import ChatBody
from draftgen.core.config import Config
from draftgen.core.config_tables import DatasetConfig
from draftgen.core.errors import ConfigError
from draftgen.core.generate.api.client import ChatClient, RequestFailed, get_failure
from draftgen.core.request_keys import body_answers, body_max_tokens, fallback_models

__all__ = ["body_answers", "body_max_tokens"]  # re-exported: where the rest of the engine reads them

TEMPLATE_TOKENS_PER_MESSAGE = 8   # role header, separators and end marker of the chat template
TEMPLATE_TOKENS = 8               # the generation prompt (assistant header, <think>)


@dataclass(frozen=True)
class Endpoint:
    """One provider's endpoint of the model, as the listing shows it."""
    provider: str
    tag: str
    quantization: str
    prompt: float        # USD per prompt token
    completion: float    # USD per completion token
    request: float = 0.0 # USD per request


@dataclass(frozen=True)
class Prices:
    """USD per token at the worst endpoint a dataset's routing allows, and where they came from."""
    prompt: float
    completion: float
    request: float
    source: str                      # "config", "endpoints listing (3 of 5 providers)"
    providers: tuple[str, ...] = ()  # the endpoints allowed by the routing

    def worst_case(self, prompt_tokens: int, max_tokens: int) -> float:
        return prompt_tokens * self.prompt + max_tokens * self.completion + self.request

    def describe(self) -> str:
        return (f"${self.prompt * 1e6:.4g}/M prompt, ${self.completion * 1e6:.4g}/M completion"
                + (f", ${self.request:.4g}/request" if self.request else "") + f" ({self.source})")


def prompt_token_bound(messages: Sequence[Mapping[str, Any]]) -> int:
    """An upper bound on the prompt tokens of `messages` (see the module docstring)."""
    n = TEMPLATE_TOKENS
    for m in messages:
        n += TEMPLATE_TOKENS_PER_MESSAGE
        content = m.get("content")
        if isinstance(content, str):
            # ASCII (a flag of the string: no scan) has one byte per character: no copy encoded to count it
            n += len(content) if content.isascii() else len(content.encode("utf-8", "surrogatepass"))
        elif content is not None:  # parts, tool calls: their JSON is longer than their text
            n += len(repr(content).encode("utf-8", "surrogatepass"))
        # An earlier turn's reasoning sent back (a conversation's history, core/generate/loop/conversations.py):
        # whether the template renders it is the provider's rule, so the bound counts it. (A message of a
        # role and a content, most of them, has none of these.)
        if len(m) > 2 or "role" not in m or "content" not in m:
            for key in ("tool_calls", "tool_call_id", "name", "reasoning", "reasoning_details", "reasoning_content"):
                if m.get(key):
                    n += len(repr(m[key]).encode("utf-8", "surrogatepass"))
    return n


def body_prompt_bound(body: ChatBody) -> int:
    """An upper bound on the prompt tokens of the request `body`: its messages, and the tool
    declarations the chat template renders into the prompt."""
    n = prompt_token_bound(body.get("messages") or ())
    if tools := body.get("tools"):
        # Templates render them as JSON (transformers' tojson: ", " and ": ", non-ASCII kept), where a `"` or
        # `\` in a string takes 2 bytes that repr may write in 1: the longer of the two.
        n += max(len(repr(tools).encode("utf-8", "surrogatepass")), _json_bytes(tools))
    return n


def _json_bytes(value: Any) -> int:
    try:
        return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError):  # not JSON data (not from a file or a config): repr counts it
        return 0


def body_worst_case(prices: Prices, body: ChatBody, default_max_tokens: int) -> float:
    """The worst-case cost of sending exactly `body`: what every reservation is made of (the run's
    admission, its retries and the smoke test's requests alike)."""
    worst = prices.worst_case(body_prompt_bound(body), body_max_tokens(body, default_max_tokens))
    return worst * body_answers(body)


def _price(raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return 0.0
    return value if value > 0 else 0.0  # "-1" marks a variable price (routers): not a price


def parse_endpoints(body: Any) -> list[Endpoint]:
    """The endpoints of a listing body; entries of another shape are skipped."""
    data = body.get("data") if isinstance(body, dict) else None
    raw = data.get("endpoints") if isinstance(data, dict) else None
    out = []
    for e in raw if isinstance(raw, list) else ():
        if not isinstance(e, dict):
            continue
        pricing = e.get("pricing")
        if not isinstance(pricing, dict):
            pricing = {}
        out.append(Endpoint(provider=str(e.get("provider_name") or ""), tag=str(e.get("tag") or ""),
                            quantization=str(e.get("quantization") or "").lower(),
                            prompt=_price(pricing.get("prompt")), completion=_price(pricing.get("completion")),
                            request=_price(pricing.get("request"))))
    return out


def _slug(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _names(e: Endpoint) -> set[str]:
    """The names routing may use for an endpoint: its provider, its tag, the tag's provider part."""
    names = {_slug(e.provider), _slug(e.tag)}
    if "/" in e.tag:
        names.add(_slug(e.tag.split("/", 1)[0]))
    return names - {""}


def allowed(endpoints: Sequence[Endpoint], routing: Any) -> list[Endpoint]:
    """The endpoints a request with this `provider` object may be served by."""
    if not isinstance(routing, dict):
        return list(endpoints)
    ignore = {_slug(str(p)) for p in routing.get("ignore") or ()}
    only = {_slug(str(p)) for p in routing.get("only") or ()}
    quants = {str(q).lower() for q in routing.get("quantizations") or ()}
    out = []
    for e in endpoints:
        names = _names(e)
        if names & ignore:
            continue
        if only and not names & only:
            continue
        if quants and e.quantization and e.quantization not in quants:
            continue
        out.append(e)
    return out


def dataset_prices(config: Config, ds: DatasetConfig, endpoints: Sequence[Endpoint] | None,
                   fallbacks: Mapping[str, Sequence[Endpoint] | None] | None = None) -> Prices | None:
    """The worst-case prices for `ds`; None when neither the config nor the listing gives any. With
    fallback models in its body (`models`), `fallbacks` holds each one's listing: a model without one
    (or whose routing allows no endpoint) leaves the dataset unpriced, since it may serve any request."""
    api = config.api
    if api.prompt_price_per_mtok is not None or api.completion_price_per_mtok is not None:
        return Prices((api.prompt_price_per_mtok or 0.0) / 1e6, (api.completion_price_per_mtok or 0.0) / 1e6, 0.0,
                      "config [api] prompt_price_per_mtok / completion_price_per_mtok")
    if not endpoints:
        return None
    body = config.request_body(ds, [])
    routing = body.get("provider")
    ok = allowed(endpoints, routing)
    if not ok:
        return None
    listed = len(endpoints)
    models = [m for m in fallback_models(body) if m != api.model]
    for model in models:
        theirs = allowed((fallbacks or {}).get(model) or (), routing)
        if not theirs:
            return None
        ok += theirs
        listed += len((fallbacks or {}).get(model) or ())
    also = f" over {1 + len(models)} models (fallbacks {', '.join(models)})" if models else ""
    return Prices(max(e.prompt for e in ok), max(e.completion for e in ok), max(e.request for e in ok),
                  f"endpoints listing: worst of {len(ok)} of {listed} providers the routing allows{also}",
                  tuple(sorted({e.provider or e.tag for e in ok})))


FREE_SUFFIX = ":free"


def zero_listing(config: Config, ds: DatasetConfig, prices: Prices | None) -> str:
    """Why the listing's $0 prices for `ds` are not trusted ("" when they are, or are not $0): on OpenRouter,
    a model (or fallback model) of the dataset's body that is not a ":free" variant."""
    if prices is None or prices.prompt or prices.completion or not config.api.server.kind.lists_prices \
            or prices.source.startswith("config"):
        return ""
    models = [config.api.model, *fallback_models(config.request_body(ds, []))]
    paid = [m for m in dict.fromkeys(models) if not m.endswith(FREE_SUFFIX)]
    if not paid:
        return ""
    return (f"the endpoints listing prices {', '.join(paid)} at $0, which is not a free model (OpenRouter's free "
            f"models' ids end in \"{FREE_SUFFIX}\"): a listing not trusted")


def require_prices(config: Config, prices: Mapping[str, Prices | None], listing_error: str) -> None:
    """With `max_usd` set, every dataset needs a price: refuse to start, saying how to set one."""
    if config.budget.max_usd is None:
        return
    missing = [name for name, p in prices.items() if p is None]
    if missing:
        raise ConfigError(
            f"{config.path}: budget.max_usd is set but no price is known for {', '.join(missing)} "
            f"({listing_error or 'the endpoints listing allows no provider for its routing'}), so the ceiling "
            "cannot be kept. Set [api] prompt_price_per_mtok and completion_price_per_mtok (USD per million "
            "tokens, the most expensive provider you may be served by), or remove budget.max_usd.")


def endpoints_path(model: str) -> str:
    """`/models/{author}/{slug}/endpoints` for a model id like "moonshotai/kimi-k2.5"."""
    return f"/models/{model.strip('/')}/endpoints"


async def _listing(client: ChatClient, model: str) -> tuple[list[Endpoint] | None, str]:
    """One model's endpoints, or None and why not."""
    path = endpoints_path(model)
    try:
        endpoints = parse_endpoints(await client.get_json(path))
        return endpoints, "" if endpoints else f"GET {path} lists no endpoints"
    except RequestFailed as e:
        return None, get_failure(path, e)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return None, f"GET {path}: {type(e).__name__}: {e}"


async def fetch_prices(client: ChatClient, config: Config) -> tuple[dict[str, Prices | None], str]:
    """Every dataset's worst-case prices, and why a listing could not be used ("" when all could): the
    model's, and each fallback model's a dataset's body names."""
    endpoints: list[Endpoint] | None = None
    fallbacks: dict[str, list[Endpoint] | None] = {}
    error = ""
    api = config.api
    if api.prompt_price_per_mtok is None and api.completion_price_per_mtok is None:
        endpoints, error = await _listing(client, api.model)
        if config.api.server.kind.lists_prices:  # `models` is OpenRouter's (left out of a self-hosted body)
            for ds in config.datasets:
                for model in fallback_models(config.request_body(ds, [])):
                    if model != api.model and model not in fallbacks:
                        fallbacks[model], why = await _listing(client, model)
                        error = error or (f"fallback model {model}: {why}" if why else "")
    out: dict[str, Prices | None] = {}
    for ds in config.datasets:
        p = out[ds.name] = dataset_prices(config, ds, endpoints, fallbacks)
        if why := zero_listing(config, ds, p):
            out[ds.name] = None
            error = error or why
    return out, error
