"""Money from a server is checked before it is believed (issue 50): a hostile or broken upstream on
127.0.0.1 (a small aiohttp server of this file's own) that bills honestly by its own tally but says
something else in `usage`, its generation records or its endpoints listing. "Billed" is always the
server's own tally, never draftgen's ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from draftgen.core.errors import ConfigError
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.events import EventKind
from draftgen.core.live.summary import summary_lines
from draftgen.core.rundir import RunDir
from tests.helpers import TEST_KEY, dataset_row, make_config, serve_local

PROMPT_USD, COMPLETION_USD = 0.6e-6, 3.0e-6  # what the server really bills per token
PROMPT_TOKENS, COMPLETION_TOKENS = 40, 100
TRUE_COST = PROMPT_TOKENS * PROMPT_USD + COMPLETION_TOKENS * COMPLETION_USD  # $0.000324 an answer
MAX_TOKENS = 200


class HostileServer:
    """OpenRouter's chat completions, endpoints listing, /key, /credits and /generation, enough for a run.
    Each answer is billed TRUE_COST on `billed` (the server's own tally); what `usage` says is `usage(n)` for
    the n-th answer (from 1), what its generation record says `record_cost(n)`; the listing's prices are
    `listed` (USD per token, as strings)."""

    def __init__(self, usage: Callable[[int], dict[str, Any]] | None = None,
                 record_cost: Callable[[int], Any] | None = None,
                 listed: tuple[str, str] = (str(PROMPT_USD), str(COMPLETION_USD)), key_usage: Any = None,
                 delay_s: float = 0.0) -> None:
        self.usage = usage or (lambda n: honest_usage())
        self.record_cost = record_cost or (lambda n: TRUE_COST)
        self.listed = listed
        self.key_usage = key_usage  # what GET /key says the key spent (None: the truth, `billed`)
        self.delay_s = delay_s  # before each answer
        self.first_sent = False  # an answer went out
        self.peak_before_first = 0  # the most in flight at once while no answer had gone out
        self.billed = 0.0
        self.answers = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> HostileServer:
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", self.chat)
        app.router.add_get("/api/v1/models/{author}/{slug}/endpoints", self.endpoints)
        app.router.add_get("/api/v1/key", self.key)
        app.router.add_get("/api/v1/credits", self.credits)
        app.router.add_get("/api/v1/generation", self.generation)
        self._runner, port = await serve_local(app)
        self.url = f"http://127.0.0.1:{port}/api/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["max_tokens"] == MAX_TOKENS
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if not self.first_sent:
            self.peak_before_first = max(self.peak_before_first, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            self.first_sent = True
            self.answers += 1
            self.billed += TRUE_COST
            n = self.answers
            answer = {"id": f"gen-{n}", "model": "moonshotai/kimi-k2.5", "provider": "Hostile", "object":
                      "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", "native_finish_reason":
                      "stop", "message": {"role": "assistant", "content": f"Answer {n}.", "reasoning": "Think."}}],
                      "usage": self.usage(n)}
            return web.Response(body=orjson.dumps(answer), content_type="application/json",
                                headers={"X-Generation-Id": f"gen-{n}"})
        finally:
            self.in_flight -= 1

    async def endpoints(self, request: web.Request) -> web.Response:
        prompt, completion = self.listed
        return web.json_response({"data": {"id": "moonshotai/kimi-k2.5", "endpoints": [
            {"provider_name": "Hostile", "tag": "hostile/int4", "quantization": "int4",
             "pricing": {"prompt": prompt, "completion": completion, "request": "0"}}]}})

    async def key(self, request: web.Request) -> web.Response:
        usage = self.billed if self.key_usage is None else self.key_usage
        return web.Response(body=orjson.dumps({"data": {"label": "test", "usage": usage, "limit": None,
                                                        "limit_remaining": None, "is_free_tier": False}}),
                            content_type="application/json")

    async def credits(self, request: web.Request) -> web.Response:
        return web.json_response({"data": {"total_credits": 100.0, "total_usage": self.billed}})

    async def generation(self, request: web.Request) -> web.Response:
        n = int(request.query["id"].removeprefix("gen-"))
        if not 1 <= n <= self.answers:
            return web.json_response({"error": {"code": 404, "message": "not found"}}, status=404)
        return web.Response(body=orjson.dumps({"data": {"id": f"gen-{n}", "total_cost": self.record_cost(n),
                                                        "native_tokens_prompt": PROMPT_TOKENS,
                                                        "native_tokens_completion": COMPLETION_TOKENS,
                                                        "provider_name": "Hostile"}}),
                            content_type="application/json")


def honest_usage(**over: Any) -> dict[str, Any]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "total_tokens": 140,
            "cost": TRUE_COST, **over}


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


def _config(tmp_path: Path, url: str, n: int, *, max_usd: float | None, concurrency: int = 8) -> Any:
    tables: dict[str, dict[str, Any]] = {"api": {"kind": "openrouter", "stream": False, "generation_lookup_s": 2}}
    if max_usd is not None:
        tables["budget"] = {"max_usd": max_usd}
    return make_config(tmp_path, url, [{"name": "a", "n": n, "concurrency": concurrency, "max_tokens": MAX_TOKENS}],
                       tables=tables)


class Run:
    """One run of the engine, with the events it said."""

    def __init__(self, engine: Engine, events: list[tuple[str, str]]) -> None:
        self.engine = engine
        self.events = events

    def said(self, kind: EventKind) -> list[str]:
        return [msg for k, msg in self.events if k == kind]


async def _run(cfg: Any) -> Run:
    events: list[tuple[str, str]] = []
    engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p:
                    events.append((p.kind, p.text())))
    await engine.run()
    return Run(engine, events)


async def test_a_negative_cost_then_an_honest_run_bills_at_most_max_usd(tmp_path):
    # Every answer says it cost -$5; the generation records say so too. Before: the ledger went deeply
    # negative, so the ceiling saw endless room and every prompt was asked (and billed), in this run and the next.
    max_usd = 0.01
    async with HostileServer(usage=lambda n: honest_usage(cost=-5), record_cost=lambda n: -5) as server:
        run = await _run(_config(tmp_path, server.url, 200, max_usd=max_usd))
        assert server.billed <= max_usd
        assert run.engine.errors["bad_bill"] == server.answers > 0
        said = run.said(EventKind.BAD_BILL)
        assert any("a negative usage.cost" in m for m in said), said
        assert len([m for m in said if "usage.cost" in m]) == 1  # once per kind, however many came
        # Their generation records say -5 too: not believed either, settled at the worst case (said once).
        assert len([m for m in said if "generation record says it cost -5" in m]) == 1, said
        server.usage = lambda n: honest_usage()
        server.record_cost = lambda n: TRUE_COST
        await _run(_config(tmp_path, server.url, 200, max_usd=max_usd))
        billed = server.billed
    print(f"cost -5 then an honest run: billed ${billed:.6f} of max_usd ${max_usd}, {server.answers} answers")
    assert billed <= max_usd
    assert SpendLedger.read(RunDir(tmp_path / "run").spend).committed_usd <= max_usd + 1e-9


async def test_a_zero_listing_for_a_paid_model_at_concurrency_50_bills_at_most_max_usd(tmp_path):
    # The listing says $0 for a model whose id has no ":free": before, every reservation was $0 and all
    # 300 prompts went out, 50 at a time. Now that dataset has no price: with max_usd the run does not start.
    max_usd = 0.01
    async with HostileServer(listed=("0", "0")) as server:
        with pytest.raises(ConfigError, match=r"\$0.*:free"):
            await _run(_config(tmp_path, server.url, 300, max_usd=max_usd, concurrency=50))
        assert server.billed <= max_usd and server.answers == 0


async def test_a_listing_below_the_bills_is_raised_after_a_small_first_wave(tmp_path):
    # The listing is a hundred times below what the provider bills. Before: reservations a hundredth of
    # the bills, so 50 went out at once and the whole file (~$0.097) was billed under a $0.01 ceiling.
    max_usd = 0.01
    low = (str(PROMPT_USD / 100), str(COMPLETION_USD / 100))
    async with HostileServer(listed=low, delay_s=0.05) as server:
        run = await _run(_config(tmp_path, server.url, 300, max_usd=max_usd, concurrency=50))
        billed = server.billed
        assert server.peak_before_first <= 4  # the first wave, until a bill checks the listing
        # The next run of the directory starts from the prices the bills showed: no first wave.
        again = await _run(_config(tmp_path, server.url, 300, max_usd=1.0, concurrency=50))
        assert server.peak_in_flight > 4
    print(f"listing 100x low at concurrency 50: billed ${billed:.6f} of max_usd ${max_usd}, "
          f"{server.peak_before_first} in flight before the first answer")
    assert billed <= max_usd
    assert billed >= 0.5 * max_usd  # the ceiling is used, not stopped by the first bill
    raised = run.said(EventKind.PRICES)
    assert any("at most 4 requests in flight" in m for m in raised), raised
    assert any("reservations now use the highest bill seen" in m for m in raised), raised
    for prices in (run.engine.prices["a"], again.engine.prices["a"]):
        assert prices is not None and prices.completion >= COMPLETION_USD * 0.99
    assert not any("at most 4 requests in flight" in m for m in again.said(EventKind.PRICES))
    assert dataset_row(again.engine, "a").done == 300


async def test_generation_records_above_the_listing_raise_it_too(tmp_path):
    # Answers without usage.cost are priced from their generation records; a record a hundred times above
    # the listing raises the reservations as an answer's bill would. Before: the listing was believed.
    low = (str(PROMPT_USD / 100), str(COMPLETION_USD / 100))
    no_cost = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS}
    async with HostileServer(listed=low, usage=lambda n: no_cost) as server:
        run = await _run(_config(tmp_path, server.url, 6, max_usd=1.0))
        billed = server.billed
    raised = run.said(EventKind.PRICES)
    assert any("(its generation record) billed" in m and "reservations now use" in m for m in raised), raised
    prices = run.engine.prices["a"]
    assert prices is not None and prices.completion >= COMPLETION_USD * 0.99
    assert SpendLedger.read(RunDir(tmp_path / "run").spend).committed_usd == pytest.approx(billed)


async def test_an_absurd_cost_leaves_the_next_run_free_to_go_on(tmp_path):
    # The first answer says it cost $1e9, and so does its generation record. Before: booked as such, the
    # directory stayed LIMITED for good and the next run asked nothing.
    max_usd = 0.05
    async with HostileServer(usage=lambda n: honest_usage(cost=1e9 if n == 1 else TRUE_COST),
                             record_cost=lambda n: 1e9 if n == 1 else TRUE_COST) as server:
        run = await _run(_config(tmp_path, server.url, 5, max_usd=max_usd))
        assert dataset_row(run.engine, "a").done == 5
        assert run.engine.errors["bad_bill"] == 1
        assert any("a cost beyond what the request could cost" in m for m in run.said(EventKind.BAD_BILL))
        # More prompts in the same directory: the next run goes on and answers them.
        run = await _run(_config(tmp_path, server.url, 20, max_usd=max_usd))
        assert dataset_row(run.engine, "a").done == 20
        assert server.answers == 20
        billed = server.billed
    ledger = SpendLedger.read(RunDir(tmp_path / "run").spend)
    assert billed <= ledger.committed_usd <= max_usd


@pytest.mark.parametrize("counts", [{"prompt_tokens": "forty", "completion_tokens": None},
                                    {"prompt_tokens": None, "completion_tokens": "1e2"},
                                    {"prompt_tokens": -40, "completion_tokens": True}])
async def test_string_and_null_token_counts_are_handled_not_crashed(tmp_path, counts):
    # Before: "ValueError: invalid literal for int()" (or a negative count booked): the answer, paid for,
    # was dropped as an engine error and held at its worst case.
    async with HostileServer(usage=lambda n: honest_usage(**counts)) as server:
        run = await _run(_config(tmp_path, server.url, 6, max_usd=1.0))
        billed = server.billed
    assert dataset_row(run.engine, "a").done == 6
    assert run.engine.errors["bad_bill"] == 6
    assert not run.said(EventKind.REQUEST_ERROR)
    rows = [orjson.loads(line) for line in RunDir(tmp_path / "run").responses("a").read_bytes().splitlines()]
    assert len(rows) == 6
    said = run.said(EventKind.BAD_BILL)
    assert len(said) == 1 and "token counts that are not counts" in said[0], said
    summary = " ".join(summary_lines(run.engine.snapshot(), 0))
    assert "6 with a bill not believed" in summary, summary
    # Priced from the generation records (honest here), checked like any figure.
    ledger = SpendLedger.read(RunDir(tmp_path / "run").spend)
    assert ledger.committed_usd == pytest.approx(billed)


async def test_a_negative_key_usage_is_not_kept_as_the_baseline(tmp_path):
    # GET /key's usage is the baseline `draftgen ledger --unknown-from-key` prices lost attempts from. Before:
    # -5 was kept as it, so $5 more of the key's usage than there was looked like this directory's spend.
    async with HostileServer(key_usage=-5) as server:
        run = await _run(_config(tmp_path, server.url, 2, max_usd=1.0))
    assert dataset_row(run.engine, "a").done == 2
    assert SpendLedger.read(RunDir(tmp_path / "run").spend).key_baseline is None


def test_a_ledger_with_bad_costs_read_back_counts_their_reservations(tmp_path):
    # Lines an older version wrote as a server said them: each counts at its reservation, so no one line
    # makes the directory's ledger unusable (LIMITED for good, or room without end).
    path = tmp_path / "spend.jsonl"
    lines = []
    for i, cost in enumerate([-5, 1e9, float("nan"), 0.0003]):
        lines += [{"e": "sent", "a": f"x{i}", "ds": "a", "p": f"p{i}", "w": 0.001, "t": 1.0},
                  {"e": "end", "a": f"x{i}", "o": "answered", "c": cost, "s": "usage.cost"}]
    lines += [{"e": "sent", "a": "y", "ds": "a", "p": "q", "w": 0.002, "t": 1.0},
              {"e": "end", "a": "y", "o": "abandoned", "c": None, "s": "pending"},
              {"e": "settle", "a": "y", "c": -1e6, "s": "generation"}]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    ledger = SpendLedger.read(path)
    assert ledger.committed_usd == pytest.approx(0.001 * 3 + 0.0003 + 0.002)
