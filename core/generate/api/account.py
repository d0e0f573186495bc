"""The account behind the key, as OpenRouter reports it: `GET /key` and `GET /credits`.

- `GET /api/v1/key` answers any key: `data.limit` (null: no per-key cap), `data.usage`,
  `data.limit_remaining` (null without a cap), `data.limit_reset`, `data.is_free_tier`. A 401 here
  means the key itself is refused.
- `GET /api/v1/credits` answers management keys only: `data.total_credits`, `data.total_usage`.
  It is read with the key `[api] management_key_env` names, else with the run's key (a local server
  may answer it). An ordinary inference key gets 401 or 403 there, which says only that it is not a
  management key, never that it cannot run completions: "balance unknown", never a bad key.

The balance is the credits left when /credits answers, else the key's `limit_remaining` when the key
has a cap, else unknown: a warning, not a failure (the run goes on under `max_usd`). When both are
known the smaller one is the balance. Both reads are one `AccountStatus`, the single home of
these two endpoints for the engine (balance, account re-checks) and smoke.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from draftgen.core.generate.api.classify import AccountCondition

if TYPE_CHECKING:
    from draftgen.core.generate.api.client import ChatClient


def _num(value: Any) -> float | None:
    """A figure of GET /key or /credits: a finite number (a numeric string too), else None (not given)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _usd(value: Any) -> float | None:
    """A figure that cannot be negative (a cap, a usage, credits bought): `_num`, None when negative."""
    out = _num(value)
    return out if out is not None and out >= 0 else None


@dataclass(frozen=True)
class AccountStatus:
    """What GET /key and GET /credits said (None: not given, or that endpoint did not answer)."""
    label: str | None = None
    key_limit: float | None = None          # the key's cap in USD; None: no cap
    key_usage: float | None = None
    limit_remaining: float | None = None    # None without a cap
    limit_reset: str | None = None          # "daily", "weekly", "monthly" or None
    is_free_tier: bool | None = None
    total_credits: float | None = None      # /credits, management keys only
    total_usage: float | None = None
    key_read: bool = False                  # GET /key answered
    credits_note: str = ""                  # why /credits gave no balance (empty when it did)

    @property
    def credits_left(self) -> float | None:
        if self.total_credits is None:
            return None
        return self.total_credits - (self.total_usage or 0.0)

    @property
    def balance(self) -> float | None:
        """Credits left (management key), else the room under the key's cap, else None (unknown)."""
        left = self.credits_left
        if left is not None:
            return left if self.limit_remaining is None else min(left, self.limit_remaining)
        return self.limit_remaining

    @property
    def balance_source(self) -> str:
        """Where `balance` comes from, in a word: "credits", "key limit" or "unknown" (the smaller of
        the credits left and the room under the key's cap when both are known)."""
        left = self.credits_left
        if left is not None and (self.limit_remaining is None or left <= self.limit_remaining):
            return "credits"
        if self.limit_remaining is not None:
            return "key limit"
        return "unknown"

    @property
    def balance_detail(self) -> str:
        """Where `balance` comes from, spelled out: the endpoint read, or why none gave a balance."""
        source = self.balance_source
        if source == "credits":
            return "GET /credits"
        if source == "key limit":
            return f"GET /key limit_remaining of a ${self.key_limit or 0:.2f} key cap"
        notes = [self.credits_note or "GET /credits gave no balance"]
        if self.key_read:
            notes.append("the key has no spending cap (GET /key limit null)")
        return "unknown (" + "; ".join(notes) + ")"


def status_from(key: dict[str, Any] | None, credits: dict[str, Any] | None,
                credits_note: str = "") -> AccountStatus:
    """An AccountStatus from the `data` objects of the two endpoints (either may be None)."""
    k = key if isinstance(key, dict) else {}
    c = credits if isinstance(credits, dict) else {}
    label = k.get("label")
    free = k.get("is_free_tier")
    reset = k.get("limit_reset")
    return AccountStatus(
        label=str(label) if label is not None else None, key_limit=_usd(k.get("limit")),
        key_usage=_usd(k.get("usage")), limit_remaining=_num(k.get("limit_remaining")),
        limit_reset=str(reset) if reset else None, is_free_tier=free if isinstance(free, bool) else None,
        total_credits=_usd(c.get("total_credits")), total_usage=_usd(c.get("total_usage")),
        key_read=key is not None, credits_note=credits_note)


async def read_account(client: ChatClient, *, management_key: str = "", timeout_s: float = 30.0) -> AccountStatus:
    """GET /key with the run's key, then GET /credits with `management_key` (else the run's key).
    Raises the client's RequestFailed when /key refuses the key (401) or cannot be reached; a /credits
    that refuses the key only leaves the credits unknown (`credits_note` says why)."""
    from draftgen.core.generate.api.client import RequestFailed

    async with asyncio.timeout(timeout_s):  # not wait_for: on Python 3.11 it can swallow a cancel
        key = (await client.get_json("/key")).get("data")
    which = "the management key" if management_key else "the run's key"
    credits: Any = None
    note = ""
    try:
        async with asyncio.timeout(timeout_s):
            credits = (await client.get_json("/credits", key=management_key or None)).get("data")
        if not isinstance(credits, dict) or "total_credits" not in credits:
            credits, note = None, "GET /credits answered without total_credits"
    except RequestFailed as e:
        refused = e.status in (401, 403) and not management_key
        note = (f"GET /credits refused {which} ({e.status}: not a management key; set [api] management_key_env)"
                if refused else f"GET /credits with {which}: {e.message}")
    except (TimeoutError, aiohttp.ClientError, ValueError, TypeError) as e:
        note = f"GET /credits: {type(e).__name__}"
    return status_from(key if isinstance(key, dict) else {}, credits, note)


async def read_key_usage(client: ChatClient, timeout_s: float = 30.0) -> float | None:
    """GET /key's `data.usage` alone (None when it shows none); raises as `read_account` does."""
    async with asyncio.timeout(timeout_s):
        key = (await client.get_json("/key")).get("data")
    return _num(key.get("usage")) if isinstance(key, dict) else None


# -- account conditions: what stops admission run-wide, and what clears it -----------------------

_WHAT = {
    AccountCondition.KEY_REFUSED: "the API key was refused (401)",
    AccountCondition.OUT_OF_CREDITS: "out of credits (402)",
    AccountCondition.KEY_LIMIT: "the key's spending limit is reached (403 openrouter_key_limit)",
    AccountCondition.GUARDRAIL_BUDGET: "a guardrail budget is spent (403 openrouter_guardrail_budget)",
    AccountCondition.WORKSPACE_BUDGET: "the workspace budget is spent (403 openrouter_workspace_budget)",
    AccountCondition.FORBIDDEN: "the key may not run these requests (403)",
    AccountCondition.CREDIT_FLOOR: "the balance reached credit_floor_usd",
}
_TODO = {
    AccountCondition.KEY_REFUSED: "check the key (revoked? set the right one in the environment variable "
                                  "the config names) and run the same command again",
    AccountCondition.OUT_OF_CREDITS: "add credits at https://openrouter.ai/settings/credits",
    AccountCondition.KEY_LIMIT: "raise the key's limit at https://openrouter.ai/settings/keys or wait for it "
                                "to reset",
    AccountCondition.GUARDRAIL_BUDGET: "raise the guardrail's budget or wait for it to reset",
    AccountCondition.WORKSPACE_BUDGET: "raise the workspace budget or wait for it to reset",
    AccountCondition.FORBIDDEN: "check the key's permissions and guardrails",
    AccountCondition.CREDIT_FLOOR: "add credits at https://openrouter.ai/settings/credits (or lower [budget] "
                                   "credit_floor_usd)",
}


def parse_resets_at(value: Any) -> float | None:
    """`resets_at` (ISO 8601, e.g. 2026-12-01T00:00:00.000Z) as unix time, else None."""
    if not isinstance(value, str) or not value:
        return None
    from datetime import datetime
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class AccountStop:
    """The account condition that stopped admission: what the service said and when it may clear."""
    condition: AccountCondition
    detail: str                      # the service's message (redacted by the caller)
    limit_usd: float | None = None
    spend_usd: float | None = None
    resets_at: str | None = None     # as sent

    @classmethod
    def of(cls, condition: AccountCondition, detail: str, metadata: dict[str, Any]) -> AccountStop:
        resets = metadata.get("resets_at")
        return cls(condition, detail, _num(metadata.get("limit_usd")), _num(metadata.get("spend_usd")),
                   resets if isinstance(resets, str) and resets else None)

    @property
    def recheck(self) -> str:
        """How it clears by itself (empty: only `r` / SIGUSR1 or running again)."""
        c = self.condition
        if c is AccountCondition.KEY_LIMIT:
            return "resumes by itself when GET /key shows room under the limit"
        if c in (AccountCondition.OUT_OF_CREDITS, AccountCondition.CREDIT_FLOOR):
            return "resumes by itself when the balance shows credit again"
        if self.resets_at and c in (AccountCondition.GUARDRAIL_BUDGET, AccountCondition.WORKSPACE_BUDGET):
            return f"resumes by itself at {self.resets_at}"
        return ""

    def alert(self, paused: bool = True) -> str:
        """What happened, what to do, and when it resets: the run's alert."""
        what = _WHAT[self.condition]
        if self.condition is AccountCondition.CREDIT_FLOOR:
            what += f" ({self.detail})"
        spend = ""
        if self.limit_usd is not None:
            spend = f" (spent ${self.spend_usd or 0:.2f} of ${self.limit_usd:.2f}"
            spend += f", resets at {self.resets_at})" if self.resets_at else ")"
        elif self.resets_at:
            spend = f" (resets at {self.resets_at})"
        if not paused:
            return (f"{what}{spend}: {self.detail}. Admission stopped, requests in flight finish, nothing is "
                    f"failed; {_TODO[self.condition]}.")
        how = self.recheck
        return (f"{what}{spend}. Admission stopped run-wide, nothing failed; {_TODO[self.condition]}. "
                f"{how + '; ' if how else ''}r resumes now (headless: kill -USR1 <pid>).")

    def cleared_by(self, status: AccountStatus, *, need_usd: float, floor_usd: float, now: float) -> bool:
        """Whether a fresh read of the account shows room again."""
        c = self.condition
        if c is AccountCondition.KEY_LIMIT:
            return status.key_read and (status.limit_remaining is None or status.limit_remaining > need_usd)
        if c in (AccountCondition.OUT_OF_CREDITS, AccountCondition.CREDIT_FLOOR):
            balance = status.balance
            return balance is not None and balance - need_usd > floor_usd
        resets = parse_resets_at(self.resets_at)
        return resets is not None and now >= resets and c in (AccountCondition.GUARDRAIL_BUDGET,
                                                              AccountCondition.WORKSPACE_BUDGET)
