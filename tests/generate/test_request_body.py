"""The request body is a contract: every key a request table can carry is known (refused at load
with its key, table and file, or reserved for), fallback models are priced at the worst of their own
listings, the ledger books what the service billed (never capped at the reservation), and an answer a
provider runs past max_tokens is cut, named and booked. Against the simulator's HTTP server."""

from __future__ import annotations

import pytest

from draftgen.core.errors import ConfigError
from draftgen.core.generate.api.client import ChatClient
from draftgen.core.generate.api.prices import body_worst_case, fetch_prices
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.live.events import EventKind, Payload
from draftgen.core.live.payloads import OverReservation, ProviderPastCap
from draftgen.core.rundir import RunDir
from draftgen.core.server_kinds import OpenAICompatible
from draftgen.simulator import SimConfig, SimServer
from draftgen.simulator.config import SimProvider
from tests.helpers import TEST_KEY, dataset_row, make_config

URL = "https://openrouter.ai/api/v1"


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


def _tokenizer():
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    return bundled_kimi_path()


# -- refused at load ----------------------------------------------------------------------------

REFUSED = [
    ({"n": 8}, "n = 8"),
    ({"best_of": 3}, "best_of = 3"),
    ({"messages": [{"role": "user", "content": "fixed"}]}, "messages"),
    ({"model": "openai/o1-pro"}, "model"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"my_key": 1}, "my_key"),
    ({"route": "cheapest"}, "route"),
    ({"models": "openai/o1-pro"}, "models"),
    ({"reasoning": {"max_tokens": 30000}}, "reasoning.max_tokens = 30000"),
    ({"max_output_tokens": 30000}, "max_output_tokens = 30000"),
    ({"max_new_tokens": 30000}, "max_new_tokens = 30000"),
    ({"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("request_table", "named"), REFUSED, ids=[r[1].split()[0] for r in REFUSED])
def test_a_dataset_request_key_that_changes_the_bill_or_the_prompt_is_refused_naming_key_table_and_file(
        tmp_path, request_table, named):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, URL, [{"name": "b4", "n": 1, "max_tokens": 1000, "request": request_table}])
    msg = str(e.value)
    assert str(tmp_path / "draftgen.toml") in msg and f"datasets[0].request.{named}" in msg, msg
    assert "b4" in msg, msg


@pytest.mark.parametrize(("request_table", "named"), REFUSED[:7], ids=[r[1].split()[0] for r in REFUSED[:7]])
def test_the_same_keys_in_the_top_level_request_table_are_refused_naming_it(tmp_path, request_table, named):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, URL, [{"name": "b4", "n": 1, "max_tokens": 1000}], request=request_table)
    msg = str(e.value)
    assert str(tmp_path / "draftgen.toml") in msg and f"request.{named}" in msg and "[request]" in msg, msg


def test_an_unknown_key_listed_for_pass_through_is_sent_and_a_known_one_cannot_be_listed(tmp_path):
    cfg = make_config(tmp_path, URL, [{"name": "a", "n": 1, "request": {"my_key": 7}}],
                      tables={"api": {"request_pass_through": ["my_key"]}})
    assert cfg.request_body(cfg.datasets[0], [])["my_key"] == 7
    with pytest.raises(ConfigError, match=r"api.request_pass_through\[0\] = 'n' is a request key draftgen knows"):
        make_config(tmp_path, URL, [{"name": "a", "n": 1, "request": {"n": 8}}],
                    tables={"api": {"request_pass_through": ["n"]}})


def test_plain_keys_and_equal_caps_load(tmp_path):
    cfg = make_config(tmp_path, URL, [{"name": "a", "n": 1, "max_tokens": 500, "request": {
        "seed": 3, "top_p": 0.9, "stop": ["\n\n"], "n": 1, "max_completion_tokens": 500,
        "reasoning": {"effort": "high", "max_tokens": 400}, "models": ["z-ai/glm-4.6"], "route": "fallback"}}])
    assert cfg.datasets[0].max_tokens == 500


# -- reserved for ---------------------------------------------------------------------------------

async def test_fallback_models_are_priced_at_the_worst_of_their_own_listings(tmp_path):
    sim_cfg = SimConfig(seed=1, latency_scale=0.0, model_price_factor={"z-ai/glm-4.6": 3.0})
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [
            {"name": "plain", "n": 1, "max_tokens": 1000},
            {"name": "fallback", "n": 1, "max_tokens": 1000,
             "request": {"models": ["z-ai/glm-4.6"], "route": "fallback"}}])
        async with ChatClient(sim.base_url, TEST_KEY, concurrency=2) as client:
            prices, error = await fetch_prices(client, cfg)
        assert error == ""
        plain, fallback = prices["plain"], prices["fallback"]
        assert plain is not None and fallback is not None
        assert fallback.completion == pytest.approx(3 * plain.completion)
        assert fallback.prompt == pytest.approx(3 * plain.prompt)
        assert "z-ai/glm-4.6" in fallback.source
        body = cfg.request_body(cfg.datasets[1], [{"role": "user", "content": "hi"}])
        assert body_worst_case(fallback, body, 1000) == pytest.approx(3 * body_worst_case(plain, body, 1000))

    # A fallback model without a listing: the dataset has no price, and max_usd refuses to start.
    sim_cfg = SimConfig(seed=1, latency_scale=0.0, models=("moonshotai/kimi-k2.5",))
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [
            {"name": "fallback", "n": 2, "max_tokens": 100, "request": {"models": ["z-ai/glm-4.6"]}}],
            tables={"budget": {"max_usd": 1.0}, "tokenizer": {"path": str(_tokenizer())},
                    "engine": {"reconstruct": False}})
        async with ChatClient(sim.base_url, TEST_KEY, concurrency=2) as client:
            prices, error = await fetch_prices(client, cfg)
        assert prices["fallback"] is None and "z-ai/glm-4.6" in error
        engine = Engine(cfg, TEST_KEY, seed=1)
        with pytest.raises(ConfigError, match="no price is known for fallback"):
            await engine.run()
        assert sim.stats.requests_total == 0


def test_a_body_asking_for_n_answers_reserves_n_worst_cases():
    from draftgen.core.generate.api.prices import Prices
    p = Prices(1e-6, 4e-6, 0.0, "test")
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}
    one = body_worst_case(p, body, 100)
    assert body_worst_case(p, {**body, "n": 8}, 100) == pytest.approx(8 * one)
    # The largest cap the body carries is what the server may produce.
    assert body_worst_case(p, {**body, "max_output_tokens": 300}, 100) > one
    assert body_worst_case(p, {**body, "reasoning": {"max_tokens": 300}}, 100) > one


# -- the ledger books what the service billed ------------------------------------------------------

SOLO = SimProvider("Solo", "solo", "int4", 0.1, 5.0, 3.0, 0.9, 38.0)


async def test_an_answer_billed_past_its_reservation_is_booked_at_its_real_cost(tmp_path):
    """A self-hosted server whose answers carry no cost and run a few tokens past max_tokens (within the
    cut's margin): each is booked at its tokens x the prices, above its reservation; the ledger equals
    what the server billed, and the run names the provider."""
    sim_cfg = SimConfig(seed=3, latency_scale=0.0, mean_completion_tokens=600, length_sigma=0.1,
                        providers=(SOLO,), misbehave=("no_cost",), past_max_tokens=14)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 6, "concurrency": 2, "max_tokens": 40}],
                          tables={"api": {"kind": "openai-compatible", "prompt_price_per_mtok": 0.1,
                                          "completion_price_per_mtok": 5.0},
                                  "budget": {"max_usd": 1.0}, "tokenizer": {"path": str(_tokenizer())},
                                  "engine": {"reconstruct": False}},
                          request={"temperature": 0.6})
        events: list[tuple[str, str, str, Payload]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p:
                        events.append((p.level, p.kind, p.text(), p)))
        await engine.run()
        assert dataset_row(engine, "a").done == 6
        billed = sim.stats.billed_usd
    spend = SpendLedger.read(RunDir(cfg.run_dir).spend)
    sent = [w for w in _sent_worst(cfg)]
    assert len(sent) == 6 and billed > sum(sent)  # the server billed past the reservations
    assert spend.reconcile().total_usd == pytest.approx(billed, rel=1e-9)
    over = [data for _, kind, _, data in events if kind == EventKind.OVER_RESERVATION]
    assert over and isinstance(over[0], OverReservation) and over[0].provider == "Solo", events
    assert over[0].billed_usd > over[0].reserved_usd > 0


def _sent_worst(cfg) -> list[float]:
    import orjson
    return [x["w"] for x in map(orjson.loads, RunDir(cfg.run_dir).spend.read_bytes().splitlines())
            if x["e"] == "sent"]


# -- a provider past max_tokens ------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_a_provider_past_max_tokens_is_cut_named_and_on_the_ledger(tmp_path, stream):
    """Provider Solo runs 3,000 tokens past max_tokens 100 on every request it serves, Honest keeps to it:
    Solo's streams are cut by the client, its plain answers refused by their usage; nothing it produced is
    kept, each attempt is on the ledger at what the simulator billed, and the run names the provider."""
    honest = SimProvider("Honest", "honest", "int4", 0.1, 5.0, 3.0, 0.9, 38.0)
    sim_cfg = SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=4000, length_sigma=0.05,
                        providers=(SOLO, honest), past_max_tokens=3000, past_max_tokens_providers=("Solo",),
                        stream_chunk_tokens=16)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4, "max_tokens": 100}],
                          tables={"api": {"stream": stream}, "budget": {"max_usd": 1.0},
                                  "tokenizer": {"path": str(_tokenizer())}, "engine": {"reconstruct": False}})
        events: list[tuple[str, str, str, Payload]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p:
                        events.append((p.level, p.kind, p.text(), p)))
        await engine.run()
        billed = sim.stats.billed_usd
        served = dict(sim.stats.answers_by_provider)
    rd = RunDir(cfg.run_dir)
    import orjson
    kept = [orjson.loads(x) for x in rd.responses("a").read_bytes().splitlines()]
    assert kept and all(k["provider"] == "Honest" for k in kept)  # nothing past the cap kept
    assert all(k["usage"]["completion_tokens"] <= 100 for k in kept)
    assert served.get("Solo", 0) > 0 or not stream, served  # Solo answered (its streams reached the client)
    past = [(msg, data) for _, kind, msg, data in events if kind == EventKind.PAST_CAP]
    assert past and isinstance(past[0][1], ProviderPastCap) and past[0][1].provider == "Solo", events
    assert "max_tokens 100" in past[0][0] and "max_tokens 100" in past[0][1].cause
    if stream:  # the cut stream ran on to its end upstream: its record bills past what it was counted at
        over = [(msg, data) for _, kind, msg, data in events if kind == EventKind.OVER_RESERVATION]
        assert over and "generation record" in over[0][0], events
        assert isinstance(over[0][1], OverReservation) and over[0][1].provider == "Solo"
        assert over[0][1].billed_usd > over[0][1].reserved_usd
    r = SpendLedger.read(rd.spend).reconcile()
    assert r.pending == r.unknown == 0
    assert r.total_usd == pytest.approx(billed, rel=1e-6) and billed > 0


async def test_a_prompt_a_provider_keeps_running_past_max_tokens_fails_after_max_attempts(tmp_path):
    """Every attempt past the cap was billed, so each spends one of max_attempts even with no other
    prompt answered (an outage of other answer faults spends none): the prompt fails naming past_cap,
    after exactly max_attempts paid requests, all on the ledger."""
    sim_cfg = SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=4000, length_sigma=0.05,
                        providers=(SOLO,), past_max_tokens=3000)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 1, "max_tokens": 100}],
                          tables={"api": {"stream": False}, "budget": {"max_usd": 1.0},
                                  "tokenizer": {"path": str(_tokenizer())},
                                  "engine": {"reconstruct": False, "max_attempts": 3}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        billed, requests = sim.stats.billed_usd, sim.stats.requests_total
    import orjson
    rd = RunDir(cfg.run_dir)
    failed = [orjson.loads(x) for x in rd.failures("a").read_bytes().splitlines()]
    assert [f["error_kind"] for f in failed] == ["past_cap"] and requests == 3
    assert SpendLedger.read(rd.spend).reconcile().total_usd == pytest.approx(billed, rel=1e-9)


# -- sampling cycles ---------------------------------------------------------------------------------

async def test_sampling_cycles_go_by_the_prompt_line_and_each_answer_records_what_its_body_carried(tmp_path):
    """Prompt i of the file (0-based line) is asked with temperatures[i % 2] and reasoning_efforts[i % 3],
    whatever order the answers land in; the record's `sampling` is read from the body sent. A dataset
    without cycles writes no `sampling`."""
    import orjson
    sim_cfg = SimConfig(seed=2, latency_scale=0.0)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [
            {"name": "a", "n": 6, "concurrency": 3, "max_tokens": 200, "temperatures": [0.2, 1.4],
             "reasoning_efforts": ["low", "medium", "high"]},
            {"name": "b", "n": 2, "max_tokens": 200}],
            tables={"engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        assert dataset_row(engine, "a").done == 6
    rd = RunDir(cfg.run_dir)
    lines = [orjson.loads(x) for x in rd.responses("a").read_bytes().splitlines()]
    got = {x["id"]: x["sampling"] for x in lines}
    assert got == {f"a-{i}": {"temperature": [0.2, 1.4][i % 2], "reasoning_effort": ["low", "medium", "high"][i % 3]}
                   for i in range(6)}
    assert all("sampling" not in orjson.loads(x) for x in rd.responses("b").read_bytes().splitlines())


# -- the body a run sends, built once per dataset ---------------------------------------------------

def test_each_prompt_sends_the_configs_exact_body_and_reserves_its_worst_case_after_a_mode_is_noted(tmp_path):
    """The run keeps each dataset's body without its messages (loop/room.py): every prompt's body is byte for
    byte what Config.request_body makes, its reservation body_worst_case of it, and a server's kind, release
    or stream mode noted mid-run (the smoke test's decision) is in the very next body."""
    from types import SimpleNamespace

    import orjson

    from draftgen.core.generate.api.prices import Prices
    from draftgen.core.generate.loop.prompts import Prompt
    from draftgen.core.generate.loop.room import Room
    from draftgen.core.servers import Server

    base = "http://127.0.0.1:9/v1"
    cfg = make_config(tmp_path, base, [
        {"name": "plain", "n": 1, "max_tokens": 1000},
        {"name": "tools", "n": 1, "max_tokens": 500, "request": {"temperature": 0.2, "tools": [
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}}],
        tables={"api": {"return_token_ids": True, "prompt_price_per_mtok": 0.5, "completion_price_per_mtok": 2.0}})
    prices = {d.name: Prices(5e-7, 2e-6, 0.0, "config") for d in cfg.datasets}
    parts = SimpleNamespace(money=None, book=None, datasets={}, opened=SimpleNamespace(
        costs=SimpleNamespace(settler=None, prices=prices)))
    room = Room(SimpleNamespace(config=cfg, control=None, event=None), parts, None)  # type: ignore[arg-type]

    def check(message: str) -> dict:
        for d in cfg.datasets:
            messages = [{"role": "user", "content": message}]
            body, worst = room.request_for(SimpleNamespace(config=d), Prompt("1", messages, 1))  # type: ignore[arg-type]
            expected = cfg.request_body(d, messages)
            assert orjson.dumps(body) == orjson.dumps(expected) and body["messages"] is messages
            assert worst == body_worst_case(prices[d.name], expected, d.max_tokens) > 0
        return body

    assert "stream" not in check("first") and check("a longer prompt, ünïcode")["return_token_ids"] is True
    cfg.api.server.note_kind(OpenAICompatible())  # GET /key said 404: a self-hosted server
    cfg.api.server.note_release(Server("vllm", (0, 13, 0)))
    cfg.api.server.note_stream(True)  # its smoke test decided: streamed
    body = check("after the server was noted")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    cfg.api.server.note_stream(False)
    assert "stream" not in check("and once more")
