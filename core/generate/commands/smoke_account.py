"""The smoke test's account and money checks: the key row (GET /key, retried on an outage like the smoke
requests, within the same window), each dataset's worst-case prices row, its figures for the projection
(money/forecast.py), and the balance row against the projected cost of the run."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from draftgen.core.config import Config
from draftgen.core.generate.api.account import AccountStatus, read_account
from draftgen.core.generate.api.client import ChatClient, RequestFailed, get_failure
from draftgen.core.generate.api.preflight import note_key_answer
from draftgen.core.generate.api.prices import body_max_tokens, body_worst_case
from draftgen.core.generate.commands.smoke_rows import SmokeRow, quoted, smoke_body
from draftgen.core.generate.loop.service import backoff_delay
from draftgen.core.generate.loop.smoke_request import outage
from draftgen.core.generate.money.forecast import DatasetFigures, RunForecast
from draftgen.core.secrets import Redactor
from draftgen.core.units import usd

# How long (and how often) the smoke test retries an outage (429, 5xx, 408, unreachable) before its
# row fails: a momentary rate limit must not end a nohup job before it starts, a real outage must.
SMOKE_RETRY_S = 120.0
SMOKE_TRIES = 8


class KeyCheck:
    """GET /key and its row: the account read (None when the key row failed), the tries it took, and
    whether the address answered at all (`unreachable`: the prices row's advice is about the network)."""

    def __init__(self, config: Config, redact: Redactor, rng: random.Random) -> None:
        self.config = config
        self.redact = redact
        self.rng = rng
        self.tries = 0
        self.account: AccountStatus | None = None
        self.unreachable = False

    async def _read_account(self, client: ChatClient, deadline: float) -> AccountStatus:
        """GET /key, retried on an outage until `deadline` (monotonic; `tries` counts the tries)."""
        eng = self.config.engine
        while True:
            self.tries += 1
            try:
                return await read_account(client, management_key=self.config.api.management_key())
            except RequestFailed as e:
                delay = backoff_delay(min(self.tries, 16), eng.backoff_base_s, eng.backoff_max_s, e.retry_after,
                                      self.rng)
                if not outage(e) or self.tries >= SMOKE_TRIES or time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)

    async def row(self, client: ChatClient, deadline: float) -> SmokeRow:
        config = self.config
        if not config.api.server.kind.has_account:
            return SmokeRow("key", True, f'n/a (self-hosted: [api] kind = "{config.api.kind}")')
        try:
            self.account = await self._read_account(client, deadline)
            note_key_answer(config, None)
            label = self.redact(str(self.account.label or "unlabelled"))
            return SmokeRow("key", True, f"accepted (label {quoted(label)})")
        except RequestFailed as e:
            self.unreachable = e.unreachable
            note_key_answer(config, e)
            tries = self.tries
            if not config.api.server.kind.has_account:
                return SmokeRow("key", True, f"n/a (self-hosted: GET /key answered {e.status}, so "
                                f"{config.api.base_url} is an openai-compatible server)")
            return SmokeRow("key", False, get_failure("/key", e) + (f" (after {tries} tries)" if tries > 1 else ""))
        except Exception as e:  # noqa: BLE001 - any network failure is this row's failure
            return SmokeRow("key", False, f"GET /key failed: {type(e).__name__}: {e}")


def price_rows(config: Config, prices: dict[str, Any], listing_error: str, unreachable: bool) -> list[SmokeRow]:
    """Each dataset's row: the worst case its routing allows and the most its smoke request can cost, or no
    price known (a failure only when `max_usd` needs one; `unreachable`: the address does not answer)."""
    rows = []
    for ds in config.datasets:
        p = prices[ds.name]
        if p is not None:
            body = smoke_body(config, ds)  # the reservation is the worst case of the body sent
            rows.append(SmokeRow(f"{ds.name}: prices", True, f"worst case {p.describe()}; at most "
                                 f"${body_worst_case(p, body, ds.max_tokens):.6f} for the smoke request at "
                                 f"max_tokens {body_max_tokens(body, ds.max_tokens)}"))
            continue
        need = config.budget.max_usd is not None
        why = listing_error or "the routing allows no listed provider"
        hint = ("; the address does not answer (see the key row): the prices are read from its listing "
                "once it does" if unreachable else
                "; max_usd needs one: set [api] prompt_price_per_mtok and completion_price_per_mtok"
                if need else "; no max_usd, so no ceiling to keep")
        rows.append(SmokeRow(f"{ds.name}: prices", not need, f"no price known ({why}){hint}", warning=not need))
    return rows


def dataset_figures(config: Config, counts: dict[str, int], on_disk: dict[str, tuple[int, int, float]],
                    prices: dict[str, Any], history: dict[str, float]) -> list[DatasetFigures]:
    """Each dataset's figures for the projection: its requests (`counts`) less the answers on disk, and
    what those cost."""
    figures = []
    for ds in config.datasets:
        n = counts[ds.name]
        answers, tokens, cost = on_disk[ds.name]
        figures.append(DatasetFigures(
            name=ds.name, remaining=max(0, n - answers), max_tokens=ds.max_tokens, concurrency=ds.concurrency,
            token_budget_left=None if ds.token_budget is None else max(0, ds.token_budget - tokens),
            answers=answers, completion_tokens=tokens, cost_usd=cost, prices=prices[ds.name],
            history_answers=history.get(ds.name, 0.0)))
    return figures


def balance_row(config: Config, account: AccountStatus | None, balance: float | None, plan: RunForecast,
                need: float | None, redact: Redactor) -> SmokeRow:
    cap = config.budget.max_usd
    if not config.api.server.kind.has_account:
        return SmokeRow("balance", True, "n/a (self-hosted): no account; the run keeps going under max_usd"
                        + (f" ({usd(cap)}, tokens at [api] prices)" if cap is not None else " (none set)"))
    if account is None:
        return SmokeRow("balance", False, "could not read the balance (GET /key failed)")
    if balance is None:
        return SmokeRow("balance", True, f"{redact(account.balance_detail)}. A warning, not a failure: the run keeps "
                        "going under max_usd" + (f" ({usd(cap)})" if cap is not None else " (none set)"), warning=True)
    floor = config.budget.credit_floor_usd
    if need is None:
        return SmokeRow("balance", balance > floor,
                        f"{usd(balance)} ({account.balance_source}); no projection (no answer came back)")
    ok = balance - floor >= need
    return SmokeRow("balance", ok, f"{usd(balance)} ({account.balance_source}) against {usd(need)} "
                    f"to finish (projected {plan.describe()}) + floor {usd(floor)}"
                    + ("" if ok else ": the run would stop at the credit floor before finishing"))
