"""Fidelity to what the model saw: the prompt check, the sample policy by cause, providers judged by their
token counts, and backends that return their own ids, against the simulator's real HTTP server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from draftgen.core.config_tables import KIMI_DEFAULT_SYSTEM
from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.live import snapshot as snap
from draftgen.core.merge.merge import merge
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.command import tokens_command
from draftgen.core.tokens.policy import SamplePolicy
from draftgen.core.tokens.reconstruct import reconstruct_record
from draftgen.core.tokens.store import TokenReader
from draftgen.core.tokens.template import load_template
from draftgen.core.tokens.tokenizer import bundled_kimi, bundled_kimi_path
from draftgen.core.tokens.workers import provider_flags, reconstruct_dataset
from draftgen.simulator import DEFAULT_PROVIDERS, SimConfig, SimProvider, SimServer
from tests.helpers import TEST_KEY, make_config

TOKENIZER = {"path": str(bundled_kimi_path())}
REQUEST = {"temperature": 0.6, "include_reasoning": True, "provider": {"ignore": ["fireworks", "baseten"]}}
FAST = dict(seed=4, latency_scale=0.0, mean_completion_tokens=160)


def rows(result):
    return {r.check: r for r in result.rows}


async def smoke(tmp_path, sim_kw=None, tables=None, request=None):
    async with SimServer(SimConfig(**{**FAST, **(sim_kw or {})}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "short", "n": 4, "max_tokens": 2048}],
                          tables={"tokenizer": TOKENIZER, **(tables or {})}, request=request or REQUEST)
        return cfg, await run_smoke(cfg, TEST_KEY)


async def generate(tmp_path, sim_kw=None, tables=None, request=None, n=40):
    """A run against the simulator, then `draftgen tokens`' reconstruction; (config, report)."""
    async with SimServer(SimConfig(**{**FAST, **(sim_kw or {})}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 8, "max_tokens": 4096}],
                          tables={"tokenizer": TOKENIZER, **(tables or {})}, request=request or REQUEST)
        state = await Engine(cfg, TEST_KEY, seed=1).run()
    assert state == snap.RunState.DONE
    return cfg, reconstruct_dataset(cfg, "a", workers=1)


# -- 1. the prompt check -------------------------------------------------------------------------------


async def test_prompt_check_passes_on_honest_answers_and_fails_on_another_system_turn(tmp_path):
    cfg, honest = await smoke(tmp_path / "honest")
    row = rows(honest)["short: prompt tokens"]
    assert honest.passed and row.passed and "(diff 0;" in row.detail

    # A server rendering Kimi's default system turn ran another prompt than the run reconstructs.
    _, other = await smoke(tmp_path / "other", {"default_system": KIMI_DEFAULT_SYSTEM})
    row = rows(other)["short: prompt tokens"]
    assert not other.passed and not row.passed
    assert f'set [tokenizer] default_system = "{KIMI_DEFAULT_SYSTEM}"' in row.detail
    assert rows(other)["short: tokens"].passed  # the answer itself is fine

    # Following the hint makes the run render what the server ran.
    _, fixed = await smoke(tmp_path / "fixed", {"default_system": KIMI_DEFAULT_SYSTEM},
                           {"tokenizer": {**TOKENIZER, "default_system": KIMI_DEFAULT_SYSTEM}})
    assert fixed.passed and "(diff 0;" in rows(fixed)["short: prompt tokens"].detail


async def test_prompt_check_in_the_validation_report(tmp_path):
    cfg, honest = await generate(tmp_path / "honest")
    assert honest.prompt.n == honest.checked == 40 and honest.prompt.share_exact == 1.0
    assert honest.prompt_mismatches == 0 and honest.kept == 40

    cfg, other = await generate(tmp_path / "other", {"default_system": KIMI_DEFAULT_SYSTEM})
    assert other.prompt_mismatches == 40 and other.prompt.share_exact == 0.0
    on_disk = orjson.loads((RunDir(cfg.run_dir).tokens("a") / "report.json").read_bytes())
    assert on_disk["prompt_token_count"]["mismatches"] == 40
    assert "prompt_token_count" in other.format() and "40 differ" in other.format()
    # Kept and reported by default; dropped when the config says so.
    assert other.kept == 40 and other.noted["prompt_mismatch"] == 40
    strict = dataclasses.replace(cfg, validation=dataclasses.replace(cfg.validation, drop_prompt_mismatch=True))
    stats = merge(strict)
    assert stats.samples == 0 and stats.dropped["prompt_mismatch"] == 40


async def test_the_default_system_turn_is_recorded_and_written_into_train_jsonl(tmp_path):
    tables = {"tokenizer": {**TOKENIZER, "default_system": KIMI_DEFAULT_SYSTEM}}
    cfg, report = await generate(tmp_path, {"default_system": KIMI_DEFAULT_SYSTEM}, tables, n=12)
    assert report.prompt_mismatches == 0 and report.kept == 12
    run = RunDir(cfg.run_dir)
    recorded = orjson.loads(run.run_json.read_bytes())["config"]["tokenizer"]
    assert recorded["default_system"] == KIMI_DEFAULT_SYSTEM
    assert recorded["system_turn"]["rendered"] == KIMI_DEFAULT_SYSTEM
    stats = merge(cfg)
    assert stats.samples == 12 and stats.system_turn == KIMI_DEFAULT_SYSTEM
    tok = bundled_kimi()
    reader = TokenReader(cfg.run_dir / "merged" / "tokens")
    for line, (entry, ids, _) in zip((cfg.run_dir / "merged" / "train.jsonl").read_bytes().splitlines(), reader):
        row = orjson.loads(line)
        assert row["id"] == entry.id
        assert row["conversations"][0] == {"role": "system", "content": KIMI_DEFAULT_SYSTEM}
        assert row["conversations"][1]["role"] == "user"
        # The ids say the same: the system turn is in the tokens the hidden states are computed on.
        assert tok.decode(ids.tolist()).startswith(f"<|im_system|>system<|im_middle|>{KIMI_DEFAULT_SYSTEM}<|im_end|>")
    # With the template's own default (none for Kimi-K2.5), no system turn is invented.
    cfg2, _ = await generate(tmp_path / "plain", n=4)
    merge(cfg2)
    first = orjson.loads((cfg2.run_dir / "merged" / "train.jsonl").read_bytes().splitlines()[0])
    assert first["conversations"][0]["role"] == "user"
    assert orjson.loads(RunDir(cfg2.run_dir).run_json.read_bytes())["config"]["tokenizer"]["system_turn"][
        "rendered"] is None


# -- 2. the sample policy by cause ---------------------------------------------------------------------


def long_record(rid: str, content: str, billed_extra: int, tok, template) -> dict:
    reasoning = " ".join(f"step {i}: the value is {i * 7 % 13}." for i in range(300))
    record = {"id": rid, "messages": [{"role": "user", "content": f"Prompt {rid}"}], "reasoning": reasoning,
              "content": content, "finish_reason": "stop", "provider": "DeepInfra", "truncated": False,
              "empty_content": False, "usage": {"completion_tokens": 0, "prompt_tokens": 0, "cost": 0.01}}
    probe = reconstruct_record(tok, template, record)
    record["usage"]["completion_tokens"] = probe.span_tokens + billed_extra
    record["usage"]["prompt_tokens"] = probe.prompt_tokens
    return record


def test_a_split_in_a_long_answer_is_kept_and_a_leaked_think_is_dropped(tmp_path: Path) -> None:
    tok = bundled_kimi()
    template = load_template("kimi-k2.5", tok)
    split = long_record("split", "The answer is 42.", 3, tok, template)
    probe = reconstruct_record(tok, template, split)
    assert 2_900 <= probe.span_tokens <= 3_300 and probe.count_diff == -3
    assert probe.failed_checks == ("token_count",)  # beyond the 2-token tolerance ...
    verdict = SamplePolicy().judge_meta(probe.index_meta())
    assert verdict.keep and verdict.notes == ("count_split",)  # ... but a split: kept, noted
    leaked = long_record("leaked", "<think>The answer is 42.", 0, tok, template)
    assert "no_think_open" in reconstruct_record(tok, template, leaked).failed_checks
    far = long_record("far", "The answer is 42.", 90, tok, template)  # 3 % off: another model
    clean = long_record("clean", "The answer is 42.", 0, tok, template)

    # Through `draftgen tokens` and merge, as a run would.
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 1}], tables={"tokenizer": TOKENIZER})
    folder = RunDir(cfg.run_dir).root / "a"
    folder.mkdir(parents=True)
    (folder / "responses.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (split, leaked, far, clean)))
    report = reconstruct_dataset(cfg, "a", workers=1)
    assert report.kept == 2 and report.dropped == {"invalid": 1, "count_mismatch": 1}
    assert report.noted == {"count_split": 1}
    stats = merge(cfg)
    kept = {orjson.loads(x)["id"] for x in (cfg.run_dir / "merged" / "train.jsonl").read_bytes().splitlines()}
    assert kept == {"a/split", "a/clean"}
    ds = stats.datasets[0]
    assert ds.dropped["invalid"] == 1 and ds.dropped["count_mismatch"] == 1
    assert ds.invalid_checks == {"no_think_open": 1}
    on_disk = orjson.loads((cfg.run_dir / "merged" / "stats.json").read_bytes())
    assert on_disk["kept_noted"]["count_split"] == 1
    assert on_disk["policy"]["split_share"] == 0.005 and on_disk["policy"]["count_tolerance"] == 2
    # The thresholds are the config's: no room for splits drops it too.
    tight = dataclasses.replace(cfg, validation=dataclasses.replace(cfg.validation, split_share=0.0))
    assert {orjson.loads(x)["id"] for x in (merge(tight) and (cfg.run_dir / "merged" / "train.jsonl")
                                            .read_bytes().splitlines())} == {"a/clean"}


# -- 3. provider fidelity ------------------------------------------------------------------------------

SKEWED = SimProvider("Skewed", "skewed", "int4", 0.40, 2.00, 2.0, 0.5, 60.0, token_skew=0.05)
PROVIDERS = (*DEFAULT_PROVIDERS[:3], SKEWED)


async def test_a_provider_serving_another_tokenizer_is_flagged_in_the_report_and_merge_can_leave_it_out(tmp_path):
    tables = {"validation": {"provider_min_answers": 8}}
    cfg, report = await generate(tmp_path, {"providers": PROVIDERS, "fallback_rate": 0.0}, tables, n=80)
    assert set(report.providers) == {"DeepInfra", "Together", "Parasail", "Skewed"}
    skewed, others = report.providers["Skewed"], report.providers["DeepInfra"]
    assert skewed.answers >= 8 and skewed.answer.share_exact == 0.0 and skewed.prompt.share_exact == 0.0
    assert others.answer.share_exact == 1.0 and others.prompt.share_exact == 1.0
    flags = provider_flags(cfg, report)
    assert [f.provider for f in flags] == ["Skewed"]
    assert flags[0].ignore_line == 'ignore = ["fireworks", "baseten", "skewed"]'
    assert flags[0].exclude_line == 'exclude_providers = ["Skewed"]'
    on_disk = orjson.loads((RunDir(cfg.run_dir).tokens("a") / "report.json").read_bytes())
    assert on_disk["provider_flags"][0]["provider"] == "Skewed"
    assert on_disk["providers"]["Skewed"]["answer"]["share_exact"] == 0.0
    assert "FLAGGED Skewed" in report.format(flags) and "mean|Δ|" in report.format(flags)
    # 5 % off is no BPE split: its answers are dropped; named in [merge] they are excluded as such.
    stats = merge(cfg)
    assert stats.dropped["count_mismatch"] == skewed.answers
    excluded = dataclasses.replace(cfg, merge=dataclasses.replace(cfg.merge, exclude_providers=["Skewed"]))
    stats = merge(excluded)
    assert stats.dropped["provider_excluded"] == skewed.answers and stats.dropped["count_mismatch"] == 0
    assert stats.samples == 80 - skewed.answers


async def test_draftgen_tokens_prints_agreement_per_provider_and_the_flag(tmp_path, capsys):
    tables = {"validation": {"provider_min_answers": 8}}
    cfg, _ = await generate(tmp_path, {"providers": PROVIDERS, "fallback_rate": 0.0}, tables, n=60)
    assert tokens_command(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, workers=1))) == 0
    out = capsys.readouterr().out
    assert "agreement per provider" in out and "usage.prompt_tokens" in out and "Skewed" in out
    assert "FLAGGED" in out and 'in [request.provider]: ignore = ["fireworks", "baseten", "skewed"]' in out
    assert 'in [merge]: exclude_providers = ["Skewed"]' in out


async def test_a_provider_serving_another_tokenizer_is_flagged_in_smoke(tmp_path):
    request = {**REQUEST, "provider": {"ignore": ["fireworks", "baseten"], "only": ["skewed"]}}
    _, result = await smoke(tmp_path, {"providers": PROVIDERS}, request=request)
    tokens = rows(result)["short: tokens"]
    assert not result.passed and not tokens.passed
    assert "Skewed counts this answer" in tokens.detail
    assert 'ignore = ["fireworks", "baseten", "skewed"]' in tokens.detail
    assert not rows(result)["short: prompt tokens"].passed


async def test_the_live_run_shows_provider_fidelity_in_the_snapshot(tmp_path):
    import asyncio

    from draftgen.core.run.pipeline import Pipeline
    async with SimServer(SimConfig(**{**FAST, "providers": PROVIDERS, "fallback_rate": 0.0}), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 8, "max_tokens": 4096}],
                          tables={"tokenizer": TOKENIZER, "engine": {"reconstruct": True, "workers": 1},
                                  "validation": {"provider_min_answers": 8}},
                          request=REQUEST)
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            assert await asyncio.wait_for(pipeline.generate(), 120) == snap.RunState.DONE
            shown = pipeline.snapshot().fidelity  # the reconstruction has finished: its last figures
        finally:
            await pipeline.close()
    by_name = {f.name: f for f in shown}
    assert by_name["Skewed"].flagged and by_name["Skewed"].answer_exact == 0.0
    assert by_name["DeepInfra"].answer_exact == 1.0 and not by_name["DeepInfra"].flagged
    again = snap.snapshot_from_dict(orjson.loads(dataclasses.replace(pipeline.snapshot(), fidelity=shown).to_json()))
    assert again.fidelity == shown  # what attach viewers receive


# -- 4. backends that return their own ids ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_returned_token_ids_are_used_and_compared(tmp_path, stream):
    tables = {"api": {"return_token_ids": True, "stream": stream}}
    cfg, report = await generate(tmp_path, None, tables, n=16)
    responses = [orjson.loads(x) for x in RunDir(cfg.run_dir).responses("a").read_bytes().splitlines()]
    assert all(isinstance(r.get("token_ids"), list) and r["token_ids"] for r in responses)
    assert report.from_backend == 16 and report.failures["matches_backend"] == 0
    agreement = next(iter(a for a in report.providers.values() if a.backend))
    assert sum(a.backend for a in report.providers.values()) == 16
    assert sum(a.backend_match for a in report.providers.values()) == 16
    assert f"{agreement.backend}/{agreement.backend}" in report.format()
    # Without the opt-in nothing is asked for, nothing comes back.
    cfg2, plain = await generate(tmp_path / "plain", None, None, n=4)
    assert plain.from_backend == 0
    assert all("token_ids" not in orjson.loads(x)
               for x in RunDir(cfg2.run_dir).responses("a").read_bytes().splitlines())


def test_the_documented_example_report_is_the_report_format():
    block = (Path(__file__).resolve().parents[2] / "docs" / "fidelity.md").read_text()
    from draftgen.core.tokens.fidelity import Agreement
    from draftgen.core.tokens.report import format_providers
    header = format_providers({"x": Agreement({0: 1}, 10, {0: 1})}).splitlines()
    assert header[0] in block and header[1] in block  # the caption, as format() prints it
    assert "    provider    answers   exact  mean|Δ|  p99|Δ|  prompt  mean|Δ|  p99|Δ|  ids=" in block
    assert "prompt_token_count" in block and "sample policy: keeps" in block and "FLAGGED" in block


def test_one_source_is_judged_on_its_own() -> None:
    """A self-hosted server has no other provider to compare with: a constant offset, or few exact
    counts, flags it with the likely cause and what to change; exact counts do not."""
    from draftgen.core.tokens.fidelity import UNKNOWN, Agreement, flag_providers
    offset, rewritten, good = Agreement(), Agreement(), Agreement()
    for i in range(30):
        offset.add(1 if i else 0, 10, 0)
        rewritten.add((0, -1, 1)[i % 3], 10, 0)
        good.add(0 if i else 1, 10, 0)
    assert flag_providers({UNKNOWN: offset}) == []  # the relative rule alone: nothing to compare with
    [f] = flag_providers({UNKNOWN: offset}, min_exact_share=0.75)
    assert f.absolute and "+1 token off" in f.reason and "constant offset" in f.reason and "template" in f.fix
    [f] = flag_providers({UNKNOWN: rewritten}, min_exact_share=0.75)
    assert "exact in 33%" in f.reason and "stream = true" in f.fix and "return_token_ids" in f.fix
    assert flag_providers({UNKNOWN: good}, min_exact_share=0.75) == []
