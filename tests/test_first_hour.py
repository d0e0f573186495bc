"""A new user's first hour (issue 25): inputs refused at the door, free checks before the first
billed request, a smoke test that could not run keeps the passing smoke.json, commands that take
the config, messages that say their cause once."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from draftgen.core.errors import DraftgenError, NoPromptError
from draftgen.core.generate.prompts import Prompt, read_prompts
from draftgen.core.generate.smoke import run_smoke
from draftgen.core.generate.spend import SpendLedger
from draftgen.core.live.headless import run_headless
from draftgen.core.rundir import RunDir
from draftgen.core.simulator import SimConfig, SimServer
from draftgen.core.tokens.tokenizer import bundled_kimi_path

from .helpers import TEST_KEY, make_config

ROWS = [{"id": 1, "prompt": "What is 2+2?"}, {"id": 2, "prompt": "Name a prime."}]


# -- 1. inputs refused at the door --------------------------------------------------------------

def test_a_json_array_file_is_an_error_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    one_line = tmp_path / "export.json"
    one_line.write_bytes(orjson.dumps(ROWS))
    pretty = tmp_path / "pretty.json"
    pretty.write_bytes(orjson.dumps(ROWS, option=orjson.OPT_INDENT_2))
    for path in (one_line, pretty):
        with pytest.raises(NoPromptError, match="a JSON array, not JSONL") as e:
            list(read_prompts(path))
        assert str(path) in str(e.value) and "jq -c '.[]'" in str(e.value)


def test_a_file_with_no_usable_line_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    with pytest.raises(NoPromptError, match="empty.jsonl: no prompt in it"):
        list(read_prompts(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": 1}\n{"text": "x"}\n')
    with pytest.raises(NoPromptError, match=r"bad.jsonl: no usable prompt in it \(line 1: no `prompt`"):
        list(read_prompts(bad))
    ok = tmp_path / "ok.jsonl"  # one usable line is enough: the others are rejections as before
    ok.write_bytes(b'{"id": 1}\n' + orjson.dumps(ROWS[0]) + b"\n")
    assert sum(isinstance(i, Prompt) for i in read_prompts(ok)) == 1


async def test_a_run_over_an_array_file_stops_before_asking_and_is_not_complete(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}, {"name": "b", "prompts": "b.json"}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}})
        (tmp_path / "b.json").write_bytes(orjson.dumps(ROWS))
        out = io.StringIO()
        with pytest.raises(DraftgenError, match="b.json: a JSON array"):
            await run_headless(cfg, TEST_KEY, interval_s=0.05, out=out, reconstruct=False)
        assert sim.stats.requests_total == 0  # not even the smoke test was paid for
    assert "(complete)" not in out.getvalue()


# -- 3. cheap checks first ----------------------------------------------------------------------

MISSING_TOKENIZER = {"tokenizer": {"path": "nobody-has/this-tokenizer-xyz"}}


async def test_smoke_loads_the_tokenizer_before_paying_and_names_the_installed_cli(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}], tables=MISSING_TOKENIZER)
        result = await run_smoke(cfg, TEST_KEY)
        assert sim.stats.requests_total == 0
    rows = {r.check: r for r in result.rows}
    assert not rows["tokenizer"].passed and "`hf download nobody-has/this-tokenizer-xyz" in rows["tokenizer"].detail
    assert "huggingface-cli" not in rows["tokenizer"].detail  # huggingface_hub >= 1.0 has no such command
    assert "not sent: the tokenizer could not be loaded" in rows["a: request"].detail


async def test_a_run_checks_the_tokenizer_before_its_smoke_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}], tables=MISSING_TOKENIZER)
        with pytest.raises(DraftgenError, match="hf download"):
            await run_headless(cfg, TEST_KEY, interval_s=0.05, out=io.StringIO(), reconstruct=True)
        assert sim.stats.requests_total == 0


async def test_a_smoke_test_refused_beside_a_run_keeps_the_passing_smoke_json(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "max_tokens": 400}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}})
        assert (await run_smoke(cfg, TEST_KEY)).passed
        rd = RunDir(cfg.run_dir)
        before = rd.smoke_json.read_bytes()
        holder = SpendLedger(rd.spend)  # a live run in another process holds the ledger
        holder.open()
        try:
            refused = await run_smoke(cfg, TEST_KEY)
        finally:
            holder.close()
    assert not refused.passed and "open in another draftgen process" in refused.summary()
    assert rd.smoke_json.read_bytes() == before
    assert any(r.check == "smoke.json" and "kept the last passing" in r.detail for r in refused.rows)


# -- 6. commands that meet the user -------------------------------------------------------------

def test_report_and_attach_take_the_config_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from draftgen.cli.main import main
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 2}])
    assert main(["report", str(cfg.path)]) == 2
    err = capsys.readouterr().err
    assert f"its run directory {cfg.run_dir} does not exist yet" in err and f"draftgen run {cfg.path}" in err
    assert main(["attach", str(cfg.path)]) == 2 and "does not exist yet" in capsys.readouterr().err
    Path(cfg.run_dir).mkdir(parents=True)
    assert main(["report", str(cfg.path)]) == 0
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory or config file" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["smoke", "run", "report", "attach", "tokens", "merge", "ledger"])
def test_positional_arguments_have_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from draftgen.cli.main import main
    with pytest.raises(SystemExit):
        main([command, "-h"])
    assert "config file" in capsys.readouterr().out
