"""`draftgen smoke` against the simulator: one passing run and one failing run per check."""

from __future__ import annotations

import orjson
import pytest

from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.run.pipeline import smoke_status
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, make_config

REQUEST = {"temperature": 0.6, "include_reasoning": True, "provider": {"ignore": ["fireworks", "baseten"]}}


async def smoke(tmp_path, sim_kw=None, tables=None, request=None):
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, **(sim_kw or {})), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "short", "n": 4, "max_tokens": 2048},
                                                   {"name": "long", "n": 4, "max_tokens": 4096}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, **(tables or {})},
                          request=request or REQUEST)
        result = await run_smoke(cfg, TEST_KEY)
    failed = {r.check for r in result.rows if not r.passed}
    return cfg, result, failed


async def test_passing_smoke_writes_fingerprint(tmp_path):
    cfg, result, failed = await smoke(tmp_path)
    assert failed == set() and result.passed
    checks = {r.check for r in result.rows}
    for name in ("key", "balance", "short: request", "short: content", "short: reasoning", "short: tool calls",
                 "short: model", "short: usage", "short: provider", "short: finish", "short: tokens",
                 "long: request"):
        assert name in checks
    saved = orjson.loads(RunDir(cfg.run_dir).smoke_json.read_bytes())
    assert saved["passed"] and saved["fingerprint"] == cfg.run_fingerprint()
    assert smoke_status(cfg) == (True, "")
    assert result.cost_per_request["short"] > 0 and result.projected_cost_usd > 0
    assert TEST_KEY not in RunDir(cfg.run_dir).smoke_json.read_text()


@pytest.mark.parametrize("sim_kw, tables, request_, expect", [
    ({"api_key": "another-key"}, None, None, {"key", "short: request"}),
    ({"credits": 0.05}, {"budget": {"credit_floor_usd": 0.045}}, None, {"balance"}),
    ({"faults": {"500": 1.0}}, None, None, {"short: request", "long: request"}),
    (None, {"smoke": {"max_tokens": 3}}, None, {"short: content", "short: finish", "short: tokens"}),
    ({"misbehave": ["no_reasoning"]}, None, None, {"short: reasoning"}),
    ({"misbehave": ["wrong_model"]}, None, None, {"short: model"}),
    ({"misbehave": ["no_cost"]}, None, None, {"short: usage"}),
    ({"misbehave": ["ignore_routing"]}, None, None, {"short: provider"}),
    ({"misbehave": ["bad_token_count"]}, None, None, {"short: tokens"}),
    ({"misbehave": ["tool_calls"]}, None, None, {"short: tool calls"}),
])
async def test_each_check_fails_when_broken(tmp_path, sim_kw, tables, request_, expect):
    cfg, result, failed = await smoke(tmp_path, sim_kw, tables, request_)
    assert not result.passed
    assert expect <= failed, (expect, failed)
    ok, why = smoke_status(cfg)
    assert not ok and "failed" in why
    if "short: finish" in expect:  # an answer cut at its cap: the row says which max_tokens to raise
        (row,) = [r for r in result.rows if r.check == "short: finish"]
        assert row.detail.endswith("cut at max_tokens 3; the smoke test checks a whole answer's ids and end of turn: "
                                   "raise [smoke] max_tokens"), row.detail


async def test_changed_parameters_need_a_new_smoke(tmp_path):
    cfg, result, _ = await smoke(tmp_path)
    assert smoke_status(cfg)[0]
    text = cfg.path.read_text().replace("temperature = 0.6", "temperature = 0.7")
    cfg.path.write_text(text)
    from draftgen.core.config_load import load_config
    ok, why = smoke_status(load_config(cfg.path))
    assert not ok and "changed" in why


def _answer(reasoning, content, token_ids=None):
    from draftgen.core.generate.api.answer import ChatAnswer
    from draftgen.core.records import Usage
    return ChatAnswer(content=content, reasoning=reasoning, tool_calls=None, finish_reason="stop",
                      native_finish_reason="stop", provider=None, model="m", generation_id=None, latency_s=0.1,
                      usage=Usage(prompt_tokens=5, completion_tokens=3), token_ids=token_ids)


def test_the_streamed_copy_never_carries_a_key_streaming_refuses():
    from draftgen.core.generate.commands.stream_check import stream_pair
    body = {"model": "m", "messages": [], "return_token_ids": True, "temperature": 0.6, "stream": True}
    streamed, plain = stream_pair(body, temperature=1.0, seed=3)
    assert "return_token_ids" not in streamed and plain["return_token_ids"] is True
    assert streamed["stream"] is True and "stream" not in plain
    assert (streamed["temperature"], streamed["seed"]) == (plain["temperature"], plain["seed"]) == (1.0, 3)


@pytest.mark.parametrize("stream, streamed, plain, passed, warning, decided, says", [
    # The parser strips the non-streamed text's edges: unset, the run streams; false fails with the fix.
    (None, (" is", " 4"), ("is", "4"), True, False, True, "reasoning parser strips leading whitespace of the "
     "reasoning and the content in non-streamed answers, so this run streams"),
    (False, (" is", " 4"), ("is", "4"), False, False, True, "set [api] stream = true"),
    (True, (" is", " 4"), ("is", "4"), True, True, True, "this run streams, so it keeps the text"),
    (None, (None, " 4\n"), (None, "4"), True, False, True, "the server's parser strips leading and trailing "
     "whitespace of the content"),
    # A parser that strips the streamed text instead: the non-streamed mode keeps it.
    (True, ("is", "4"), (" is", "4"), False, False, False, "set [api] stream = false"),
    (None, ("x", "4"), ("x", "4"), True, False, False, "streamed and non-streamed text equal"),
])
def test_the_stream_row_names_the_parser_and_the_mode_that_keeps_the_text(stream, streamed, plain, passed, warning,
                                                                          decided, says):
    from draftgen.core.generate.commands.stream_check import mode_verdict
    v = mode_verdict(stream, _answer(*streamed), _answer(*plain), "greedy request")
    assert (v.passed, v.warning, v.decided) == (passed, warning, decided), v
    assert says in v.detail, v.detail
    assert ("use stream = " in v.parser) == (not passed), v.parser


def test_what_cannot_be_compared_is_a_warning_never_a_pass():
    from draftgen.core.generate.commands.stream_check import mode_verdict, not_compared
    v = not_compared(3)
    assert v.passed and v.warning and v.decided is None and "could not compare" in v.detail
    # Sampled answers that differ beyond whitespace: the server did not draw the same (seed ignored).
    v = mode_verdict(None, _answer(" bako", " deli"), _answer("tiro", "mesa"), "sampled request", sampled=True)
    assert v.warning and v.decided is None and "could not compare" in v.detail and "seed" in v.detail
    # Non-streamed ids are the sample's: the row warns, the mode is not switched for the text alone.
    v = mode_verdict(None, _answer(" is", " 4"), _answer("is", "4", token_ids=[1, 2, 3]), "greedy request")
    assert v.warning and v.decided is None and "token ids" in v.detail


def test_a_tokens_row_that_counts_off_names_the_parser_the_stream_row_saw(tmp_path):
    from types import SimpleNamespace

    from draftgen.core.generate.commands.smoke_rows import tokens_row
    cfg = make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "a", "n": 1}],
                      tables={"api": {"kind": "openai-compatible"}})
    rec = SimpleNamespace(failed_checks=[], count_diff=1, billed_tokens=5, span_tokens=6, source="reconstructed",
                          truncated=False)
    row = tokens_row(cfg, "a:", rec, None)
    assert not row.passed and "is the chat template" in row.detail
    row = tokens_row(cfg, "a:", rec, None, parser="the server's reasoning parser strips leading whitespace of the "
                     "reasoning in non-streamed answers: use stream = true")
    assert not row.passed and "the server's parser, not the chat template" in row.detail
    assert row.detail.endswith("use stream = true")


def test_the_run_streams_as_smoke_json_records_without_a_new_fingerprint(tmp_path):
    """The mode a smoke test decided is read by the run (same shapes), leaves the fingerprint as it
    was, and never overrides an explicit `[api] stream`."""
    import dataclasses

    from draftgen.core.files import write_json_atomic
    from draftgen.core.generate.loop.smoke_record import apply_smoke_stream
    cfg = make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "a", "n": 1}],
                      tables={"api": {"kind": "openai-compatible"}})
    rd = RunDir(cfg.run_dir)
    rd.root.mkdir(parents=True, exist_ok=True)
    fingerprint = cfg.run_fingerprint()
    assert "stream" not in cfg.request_body(cfg.datasets[0], [])
    write_json_atomic(rd.smoke_json, {"fingerprint": "other", "passed": True, "stream": True})
    assert apply_smoke_stream(cfg, rd) is None and not cfg.api.streams  # another shape's decision
    write_json_atomic(rd.smoke_json, {"fingerprint": fingerprint, "passed": True, "stream": True})
    assert apply_smoke_stream(cfg, rd) is True and cfg.api.stream_decided
    body = cfg.request_body(cfg.datasets[0], [])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert cfg.run_fingerprint() == fingerprint and smoke_status(cfg)[0]
    explicit = dataclasses.replace(cfg, api=dataclasses.replace(cfg.api, stream=False))
    assert "stream" not in explicit.request_body(cfg.datasets[0], []) and not explicit.api.stream_decided


@pytest.mark.parametrize("misbehave, passed", [((), True), (("history_reasoning",), False)])
async def test_a_multi_turn_dataset_checks_the_prompt_of_a_second_turn(tmp_path, misbehave, passed):
    # A dataset that asks every turn (`turns = "all"`): the smoke test asks a second turn on its first
    # answer and checks that turn's prompt tokens, the history rendered by the template's history rule.
    from draftgen.core.generate.commands.smoke_answer import FOLLOW_UP
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, sent_log_size=16, misbehave=misbehave)) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "short", "n": 4, "max_tokens": 2048, "turns": "all"},
                                                   {"name": "long", "n": 4, "max_tokens": 4096}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}}, request=REQUEST)
        result = await run_smoke(cfg, TEST_KEY)
        sent = [s.messages for s in sim.sent]
    rows = {r.check: r for r in result.rows}
    assert rows["short: turn 2 request"].passed and "long: turn 2 request" not in rows
    assert rows["short: prompt tokens"].passed  # turn 1 agrees either way
    assert rows["short: turn 2 prompt tokens"].passed is passed
    if not passed:
        assert "turn 1 agreeing and turn 2 not" in rows["short: turn 2 prompt tokens"].detail
    # The second request carried the first answer back, and nothing else of another model.
    second = next(m for m in sent if len(m) == 3)
    first_answer = next(r for r in result.rows if r.check == "short: content").detail
    assert second[1]["role"] == "assistant" and repr(second[1]["content"][:60]) == first_answer
    # Its reasoning as OpenRouter documents it (the engine's rule, conversations.history_message): the
    # answer's reasoning_details passed back whole, not its text as well.
    assert second[1]["reasoning_details"] and "".join(d["text"] for d in second[1]["reasoning_details"])
    assert set(second[1]) == {"role", "content", "reasoning_details"}
    assert second[2] == {"role": "user", "content": FOLLOW_UP}
    assert result.passed is passed


def _conversations(path, n: int, turns: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        conv = []
        for k in range(turns):
            conv += [{"from": "human", "value": f"Conversation {i}, question {k + 1}: why?"},
                     {"from": "gpt", "value": "The dataset's own answer."}]
        lines.append(orjson.dumps({"id": f"c{i}", "conversations": conv}))
    path.write_bytes(b"\n".join(lines) + b"\n")


async def test_the_estimate_of_a_turns_all_dataset_counts_every_turn_and_the_answers_its_histories_carry(tmp_path):
    """The same 6 three-turn conversations asked once (turns = "last") and turn by turn (turns = "all"): the
    second sends 18 requests, and turns 2 and 3 carry 1 and 2 earlier answers, so it costs more than 3x."""
    _conversations(tmp_path / "prompts/chat.jsonl", 6, 3)
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [
            {"name": "once", "prompts": "prompts/chat.jsonl", "max_tokens": 2048},
            {"name": "each", "prompts": "prompts/chat.jsonl", "max_tokens": 2048, "turns": "all"},
            {"name": "two", "prompts": "prompts/chat.jsonl", "max_tokens": 2048, "turns": "all", "max_turns": 2}],
            tables={"tokenizer": {"path": str(bundled_kimi_path())}}, request=REQUEST)
        result = await run_smoke(cfg, TEST_KEY)
    assert result.passed, [r for r in result.rows if not r.passed]
    assert result.projection is not None
    by = {d.name: d for d in result.projection.datasets}
    assert (by["once"].answers_left, by["each"].answers_left, by["two"].answers_left) == (6, 18, 12)
    assert by["each"].cost_usd > 3 * by["once"].cost_usd and by["two"].cost_usd > 2 * by["once"].cost_usd
    # The history's part: 0+1+2 answers per conversation against 0+1, at the same price per answer token.
    extra_each, extra_two = by["each"].cost_usd - 3 * by["once"].cost_usd, by["two"].cost_usd - 2 * by["once"].cost_usd
    assert extra_each == pytest.approx(3 * extra_two, rel=1e-9)
    assert by["each"].high_usd > 3 * by["once"].high_usd


def test_the_forecast_adds_each_requests_earlier_answers_at_the_prompt_price():
    from draftgen.core.generate.api.prices import Prices
    from draftgen.core.generate.money.forecast import DatasetFigures, forecast, history_per_turn
    assert history_per_turn([3, 3]) == pytest.approx(1.0) and history_per_turn([1, 1]) == 0.0
    assert history_per_turn([4]) == pytest.approx(6 / 4)
    prices = Prices(1e-6, 4e-6, 0.0, "test")
    plain = DatasetFigures("a", remaining=30, max_tokens=1000, concurrency=1, token_budget_left=None, prices=prices)
    turns = DatasetFigures("b", remaining=30, max_tokens=1000, concurrency=1, token_budget_left=None, prices=prices,
                           history_answers=1.0)
    a, b = forecast([plain, turns], spent_usd=0.0, max_usd=None).datasets
    # 30 requests of 500 expected answer tokens; each of b's also carries one earlier answer of 500 prompt tokens.
    assert a.cost_usd == pytest.approx(30 * 500 * 4e-6)
    assert b.cost_usd == pytest.approx(30 * 500 * (4e-6 + 1e-6))
    assert b.high_usd == pytest.approx(30 * (1000 * 4e-6 + 1000 * 1e-6))


def test_the_smoke_request_of_a_dataset_with_cycles_carries_the_first_prompts_values(tmp_path):
    from draftgen.core.generate.commands.smoke import smoke_body
    cfg = make_config(tmp_path, "https://openrouter.ai/api/v1", [
        {"name": "a", "n": 1, "temperatures": [0.9, 0.2], "reasoning_efforts": ["high", "low"]}], request=REQUEST)
    body = smoke_body(cfg, cfg.datasets[0])
    assert body["temperature"] == 0.9 and body["reasoning"] == {"effort": "high"}
