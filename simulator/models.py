"""`GET /api/v1/models` and `GET /api/v1/models/{author}/{slug}/endpoints`, listing the
simulated providers with their prices (`pricing.prompt`/`completion`: USD per token, as
strings, as OpenRouter sends them) and limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from draftgen.simulator import responses
from draftgen.simulator.config import SimConfig, SimProvider
from draftgen.simulator.scenarios import Scenarios

DEFAULT_MODEL = "moonshotai/kimi-k2.5"
SUPPORTED_PARAMETERS = ["max_tokens", "temperature", "top_p", "stop", "seed", "reasoning", "include_reasoning",
                        "response_format", "tools", "tool_choice"]


def per_token(usd_per_m: float) -> str:
    """USD per million tokens as OpenRouter's per-token price string."""
    return f"{usd_per_m / 1e6:.10f}".rstrip("0").rstrip(".") or "0"


def completion_limit(p: SimProvider, scenarios: Scenarios) -> int:
    """The endpoint's max_completion_tokens, lowered while max_tokens_exceeded is in effect."""
    a = scenarios.live("max_tokens_exceeded")
    return p.max_completion_tokens if a is None else min(p.max_completion_tokens, a.get("limit", 4096))


class Models:
    def __init__(self, config: Callable[[], SimConfig], scenarios: Scenarios) -> None:
        self._config = config
        self._scenarios = scenarios

    def known(self, model: str) -> bool:
        models = self._config().models
        return (models is None or model in models) and not self._scenarios.live("unknown_model")

    def endpoint(self, p: SimProvider, model: str) -> dict[str, Any]:
        f = self._config().model_price_factor.get(model, 1.0)
        return {
            "name": f"{p.name} | {model}", "model_name": model, "context_length": p.context_length,
            "pricing": {"prompt": per_token(p.usd_per_m_in * f), "completion": per_token(p.usd_per_m_out * f),
                        "request": "0", "image": "0"},
            "provider_name": p.name, "tag": f"{p.slug}/{p.quantization}", "quantization": p.quantization,
            "max_completion_tokens": completion_limit(p, self._scenarios), "max_prompt_tokens": p.max_prompt_tokens,
            "supported_parameters": SUPPORTED_PARAMETERS, "status": 0, "uptime_last_30m": 99.5,
            "supports_implicit_caching": False,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        cfg = self._config()
        providers = cfg.providers
        top = max(providers, key=lambda p: p.usd_per_m_out)
        cheapest = min(providers, key=lambda p: p.usd_per_m_out)
        data = [{
            "id": model, "canonical_slug": model, "name": model, "created": 1_767_225_600,
            "context_length": max(p.context_length for p in providers),
            "pricing": {"prompt": per_token(cheapest.usd_per_m_in), "completion": per_token(cheapest.usd_per_m_out),
                        "request": "0", "image": "0"},
            "top_provider": {"context_length": top.context_length,
                             "max_completion_tokens": completion_limit(top, self._scenarios),
                             "is_moderated": False},
            "supported_parameters": SUPPORTED_PARAMETERS,
        } for model in (cfg.models or (DEFAULT_MODEL,))]
        return responses.json_response({"data": data})

    async def endpoints(self, request: web.Request) -> web.Response:
        model = f"{request.match_info['author']}/{request.match_info['slug']}"
        if not self.known(model):
            return responses.error(404, f"Model {model} not found")
        return responses.json_response({"data": {
            "id": model, "name": model, "created": 1_767_225_600, "description": "simulated",
            "architecture": {"tokenizer": "Other", "instruct_type": None, "modality": "text->text",
                             "input_modalities": ["text"], "output_modalities": ["text"]},
            "endpoints": [self.endpoint(p, model) for p in self._config().providers],
        }})
