"""OpenRouter's provider routing over the simulated endpoints: `provider.only`, `ignore`,
`quantizations`, `order`, `sort` and `allow_fallbacks`, as its docs describe them.

Without `order` or `sort` the router load-balances by weight; with either it tries providers
in that order, and `fallback_rate` lets the first choice be "down" now and then so a run still
sees a mix of providers (and the engine's per-provider tally has something to show).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftgen.simulator.config import SimProvider


class NoEndpoints(Exception):
    """Routing left no provider; the 404 OpenRouter answers names the filters in play."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _names(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    return [str(v).strip().lower() for v in value or []]


def _matches(p: SimProvider, names: list[str]) -> bool:
    # OpenRouter accepts a provider slug ("deepinfra"), a slug with a quantization
    # ("deepinfra/int4") or the display name ("DeepInfra").
    keys = {p.slug, p.name.lower(), f"{p.slug}/{p.quantization}"}
    return any(n in keys for n in names)


def candidates(providers: Sequence[SimProvider], prefs: Any, model: str) -> list[SimProvider]:
    """Providers that may serve this request, best first (before load balancing).

    Raises NoEndpoints when the preferences exclude every provider."""
    prefs = prefs if isinstance(prefs, dict) else {}
    pool = list(providers)
    used: list[str] = []
    if prefs.get("only"):
        only = _names(prefs["only"])
        pool = [p for p in pool if _matches(p, only)]
        used.append("only")
    if prefs.get("ignore"):
        ignore = _names(prefs["ignore"])
        pool = [p for p in pool if not _matches(p, ignore)]
        used.append("ignore")
    if prefs.get("quantizations"):
        quants = set(_names(prefs["quantizations"]))
        pool = [p for p in pool if p.quantization in quants]
        used.append("quantizations")
    sort = str(prefs.get("sort") or "").lower()
    if sort == "price":
        pool.sort(key=lambda p: (p.usd_per_m_out, p.usd_per_m_in))
    elif sort == "throughput":
        pool.sort(key=lambda p: -p.tokens_per_s)
    elif sort == "latency":
        pool.sort(key=lambda p: p.ttft_s)
    if prefs.get("order"):
        order = _names(prefs["order"])
        first = [p for n in order for p in pool if _matches(p, [n])]
        first = list(dict.fromkeys(first))
        rest = [p for p in pool if p not in first]
        pool = first + (rest if prefs.get("allow_fallbacks", True) is not False else [])
        used.append("order")
    if not pool:
        filters = ", ".join(f"provider.{u}" for u in used) or "provider"
        raise NoEndpoints(f"No endpoints found for {model} matching your provider preferences "
                          f"({filters}). Configure: https://openrouter.ai/settings/preferences")
    return pool


def choose(pool: list[SimProvider], prefs: Any, draw: float, down_draw: float,
           fallback_rate: float) -> SimProvider:
    """One provider for this request from `candidates()`, given two uniform draws in [0, 1)."""
    prefs = prefs if isinstance(prefs, dict) else {}
    ordered = bool(prefs.get("order") or prefs.get("sort"))
    if not ordered:
        total = sum(p.weight for p in pool)
        x = draw * total
        for p in pool:
            x -= p.weight
            if x < 0:
                return p
        return pool[-1]
    # Ordered routing: the first provider, unless it is "down" and a fallback is allowed.
    if len(pool) > 1 and down_draw < fallback_rate and prefs.get("allow_fallbacks", True) is not False:
        return pool[1 + int(draw * (len(pool) - 1))]
    return pool[0]
