"""The account behind the key: balance, the key's own cap, the in-flight spending budget, and
`GET /api/v1/credits` and `GET /api/v1/key` as OpenRouter answers them.

- `/credits` (`data.total_credits`, `data.total_usage`) answers management keys only
  (`SimConfig.management_keys`; None: any accepted key); an ordinary key gets 403 there, which
  says nothing about whether it can run completions.
- `/key`: `data.limit` is the key's cap (null: none), `usage` what the key spent,
  `limit_remaining` the cap minus usage (null without a cap), `limit_reset`, `is_free_tier`.
- The in-flight budget (`in_flight_budget_ratio` of the balance, or the `in_flight_budget`
  scenario): the worst-case cost of each running paid request (prompt tokens x prompt price +
  max_tokens x completion price) plus that of requests finished in the last
  `in_flight_window_s`; a request that would take the sum over it gets 402 with Retry-After.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from draftgen.simulator import responses, shaping
from draftgen.simulator.config import SimConfig
from draftgen.simulator.generations import Generation
from draftgen.simulator.scenarios import Active, Scenarios
from draftgen.simulator.stats import SimStats

_RESETS = {"daily": 86_400, "weekly": 7 * 86_400, "monthly": 30 * 86_400}


class Account:
    def __init__(self, stats: SimStats, config: Callable[[], SimConfig], scenarios: Scenarios) -> None:
        self._stats = stats
        self._config = config
        self._scenarios = scenarios
        self._running: dict[str, float] = {}  # gen_id -> estimated cost
        self._running_sum = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (finished at, estimated cost)

    # -- money -----------------------------------------------------------------------------

    @property
    def spent(self) -> float:
        return self._stats.billed_usd

    def balance(self) -> float:
        """Credits left; 0 while the out_of_credits scenario is in effect."""
        if self._scenarios.live("out_of_credits"):
            return min(0.0, self._config().credits - self.spent)
        return self._config().credits - self.spent

    def key_cap(self) -> float | None:
        a = self._scenarios.live("key_limit")
        return a.get("limit") if a is not None else self._config().key_limit_usd

    def key_limited(self) -> web.Response | None:
        """The 403 of a key whose cap is reached, else None."""
        cap = self.key_cap()
        if cap is None or self.spent < cap:
            return None
        return responses.budget_403("openrouter_key_limit", cap, self.spent, self._resets_at())

    def other_budget(self, a: Active) -> web.Response:
        """The 403 of the guardrail_budget or workspace_budget scenario."""
        source = f"openrouter_{a.scenario.name}"
        return responses.budget_403(source, a.get("limit", round(self.spent, 6)), self.spent,
                                    _iso(time.time() + 86_400))

    def _resets_at(self) -> str | None:
        period = _RESETS.get(self._config().key_limit_reset or "")
        return None if period is None else _iso((time.time() // period + 1) * period)

    # -- in-flight budget ------------------------------------------------------------------

    def in_flight_budget(self) -> tuple[float, float] | None:
        """(budget in USD, window in s) when the in-flight budget is on, else None."""
        cfg = self._config()
        a = self._scenarios.live("in_flight_budget")
        ratio = a.get("ratio", 0.02) if a is not None else cfg.in_flight_budget_ratio
        if ratio is None:
            return None
        window = a.get("window", cfg.in_flight_window_s) if a is not None else cfg.in_flight_window_s
        return ratio * max(0.0, self.balance()), window

    def admit(self, estimate: float) -> web.Response | None:
        """The 402 of the in-flight budget for a request estimated at `estimate`, else None."""
        found = self.in_flight_budget()
        if found is None:
            return None
        budget, window = found
        if estimate > budget:
            return responses.weight_exceeds(budget, estimate)
        self._prune(window)
        used = self._running_sum + sum(e for _, e in self._recent)
        if used + estimate > budget:
            a = self._scenarios.live("in_flight_budget")
            wait = a.get("retry_after", window) if a is not None else window
            return responses.in_flight_exhausted(budget, used, wait or 1.0)
        return None

    def started(self, g: Generation) -> None:
        self._running[g.gen_id] = g.estimate
        self._running_sum += g.estimate

    def finished(self, g: Generation) -> None:
        est = self._running.pop(g.gen_id, None)
        if est is not None:
            self._running_sum -= est
            self._recent.append((time.monotonic(), est))
        if not self._running:
            self._running_sum = 0.0  # no float crumbs left behind
        a = self._scenarios.live("in_flight_budget")
        self._prune(a.get("window", self._config().in_flight_window_s) if a is not None
                    else self._config().in_flight_window_s)

    def _prune(self, window: float) -> None:
        """Forget requests that finished more than `window` seconds ago."""
        horizon = time.monotonic() - window
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    # -- endpoints -------------------------------------------------------------------------

    async def credits(self, request: web.Request) -> web.Response:
        cfg = self._config()
        if (denied := auth_error(request, cfg, self._scenarios)) is not None:
            return denied
        key = bearer(request)
        if cfg.credits_forbidden or (cfg.management_keys is not None and key not in cfg.management_keys):
            return responses.error(403, "Only management keys can fetch credits. "
                                        "Create one at https://openrouter.ai/settings/management-keys")
        total = self.spent + max(0.0, self.balance()) if self._scenarios.live("out_of_credits") else cfg.credits
        return responses.json_response({"data": {"total_credits": total, "total_usage": self.spent}})

    async def key(self, request: web.Request) -> web.Response:
        cfg = self._config()
        if (denied := auth_error(request, cfg, self._scenarios)) is not None:
            shaping.hostile_error(denied, cfg.hostile_text)
            return denied
        spent, cap = self.spent, self.key_cap()
        # The label is fixed (and hostile_text): the real one shows part of the key, which must never be echoed.
        return responses.json_response({"data": {
            "label": f"draftgen-simulator{cfg.hostile_text}", "usage": spent, "usage_daily": spent,
            "usage_weekly": spent, "usage_monthly": spent, "limit": cap,
            "limit_remaining": None if cap is None else max(0.0, cap - spent),
            "limit_reset": cfg.key_limit_reset if cap is not None else None, "is_free_tier": False,
            "is_provisioning_key": False, "include_byok_in_limit": False,
        }})

    def to_json(self) -> dict[str, Any]:
        found = self.in_flight_budget()
        return {"balance": self.balance(), "key_limit_usd": self.key_cap(), "key_usage_usd": self.spent,
                "in_flight_budget_usd": None if found is None else found[0],
                "in_flight_running_usd": self._running_sum}


def bearer(request: web.Request) -> str:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def auth_error(request: web.Request, cfg: SimConfig, scenarios: Scenarios | None = None) -> web.Response | None:
    """401 for a missing, wrong or (scenario revoked_key) revoked key, as on every endpoint."""
    key = bearer(request)
    if not key:
        return responses.error(401, "No auth credentials found")
    accepted = cfg.api_key is None or key == cfg.api_key or key in (cfg.management_keys or ())
    if not accepted or (scenarios is not None and scenarios.live("revoked_key")):
        return responses.error(401, "User not found." + (f" Key: {key}" if cfg.echo_key else ""))
    return None


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(ts))
