"""`draftgen smoke` against the simulator: one passing run and one failing run per check."""

from __future__ import annotations

import orjson
import pytest

from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.run.pipeline import smoke_status
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer

from .helpers import TEST_KEY, make_config

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


async def test_changed_parameters_need_a_new_smoke(tmp_path):
    cfg, result, _ = await smoke(tmp_path)
    assert smoke_status(cfg)[0]
    text = cfg.path.read_text().replace("temperature = 0.6", "temperature = 0.7")
    cfg.path.write_text(text)
    from draftgen.core.config import load_config
    ok, why = smoke_status(load_config(cfg.path))
    assert not ok and "changed" in why
