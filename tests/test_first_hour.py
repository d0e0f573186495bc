"""A new user's first hour: inputs refused at the door, free checks before the first
billed request, a smoke test that could not run keeps the passing smoke.json, commands that take
the config, messages that say their cause once."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from draftgen.core.errors import DraftgenError, NoPromptError
from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.generate.loop.prompt_files import read_prompts
from draftgen.core.generate.loop.prompts import Prompt
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.headless.printer import run_headless
from draftgen.simulator import SimConfig, SimServer

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


async def test_smoke_loads_the_tokenizer_before_paying_and_names_the_installed_cli(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    async with SimServer(SimConfig(seed=1, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}], tables=MISSING_TOKENIZER)
        result = await run_smoke(cfg, TEST_KEY)
        assert sim.stats.requests_total == 0
    rows = {r.check: r for r in result.rows}
    assert not rows["tokenizer"].passed and "`hf download nobody-has/this-tokenizer-xyz" in rows["tokenizer"].detail
    assert "huggingface-cli" not in rows["tokenizer"].detail  # huggingface_hub >= 1.0 has no such command
    assert "not sent: the tokenizer could not be loaded" in rows["a: request"].detail


async def test_a_run_checks_the_tokenizer_before_its_smoke_test(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
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


# -- 2. one voice for messages ------------------------------------------------------------------

def test_clip_cuts_at_a_word_and_says_so() -> None:
    from draftgen.core.units import clip
    text = "GET /key: cannot connect to openrouter.ai:443 (name or service not known)"
    assert clip(text, 200) == text
    cut = clip(text, 66)
    assert cut.endswith("...") and len(cut) <= 66 and text.startswith(cut[:-3]) and "not)" not in cut
    assert text[len(cut) - 3] == " " or cut[:-3].endswith(("service", "known"))


async def test_an_unreachable_address_says_its_cause_once_with_network_advice(tmp_path: Path) -> None:
    async with SimServer(SimConfig(seed=1), port=0) as sim:
        port = sim.port
    cfg = make_config(tmp_path, f"http://127.0.0.1:{port}/api/v1", [{"name": "a", "n": 2}],
                      tables={"tokenizer": {"path": str(bundled_kimi_path())}, "budget": {"max_usd": 1.0},
                              "engine": {"backoff_base_s": 0.001, "backoff_max_s": 0.002}})
    result = await run_smoke(cfg, TEST_KEY)
    prices = next(r for r in result.rows if r.check == "a: prices")
    assert prices.detail.count("GET /models/") == 1, prices.detail
    assert "the address does not answer" in prices.detail and "prompt_price_per_mtok" not in prices.detail


def _answer(**kw: object):  # noqa: ANN202 - a ChatAnswer
    from draftgen.core.generate.api.answer import ChatAnswer
    from draftgen.core.records import Usage
    base = dict(content="4", reasoning=None, tool_calls=None, finish_reason="stop", native_finish_reason="stop",
                provider="Moonshot", model="moonshotai/kimi-k2.5", generation_id="g", latency_s=0.1,
                usage=Usage(prompt_tokens=5, completion_tokens=3, cost=0.001))
    return ChatAnswer(**{**base, **kw})  # type: ignore[arg-type]


def test_smoke_rows_say_what_came_back(tmp_path: Path) -> None:
    from draftgen.core.generate.commands.smoke_answer import shape_rows
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 1}])
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 10}
    rows = {r.check: r for r in shape_rows(cfg, cfg.datasets[0], body, _answer(provider=None, reasoning="hmm"),
                                            lambda *a: None)}
    assert rows["a: provider"].detail == "no provider in the response"
    assert rows["a: reasoning"].detail == "not requested, yet 3 chars of reasoning came back"


async def test_a_failed_smoke_gate_gives_a_command_not_a_key(tmp_path: Path) -> None:
    from draftgen.core.run.pipeline import Pipeline
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, misbehave=("wrong_model",)), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 2}],
                          tables={"tokenizer": {"path": str(bundled_kimi_path())}, "engine": {"reconstruct": False}})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False)
        await pipeline.start()
        try:
            await pipeline.generate()
        finally:
            await pipeline.close()
    alert = pipeline.engine.alert or ""
    assert pipeline.exit_code == 1 and alert.startswith("the smoke test failed")
    assert "press s" not in alert and f"`draftgen smoke {cfg.path}`" in alert


async def test_a_warning_repeated_during_an_outage_is_said_once_with_a_count(tmp_path: Path) -> None:
    from draftgen.core.live.events import Level
    from draftgen.core.live.payloads import CreditsRead, Unreachable
    from draftgen.core.run.pipeline import Pipeline
    cfg = make_config(tmp_path, "http://127.0.0.1:9/api/v1", [{"name": "a", "n": 2}])
    pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False)
    seen: list[str] = []
    pipeline.hub.publish_event = lambda e: seen.append(e.message)  # type: ignore[method-assign]
    for _ in range(30):
        pipeline.emit(Unreachable(cause="cannot reach http://127.0.0.1:9 (connection refused)"))
    pipeline.emit(CreditsRead(cause="an info line is never held back", at=Level.INFO))
    pipeline.emit(CreditsRead(cause="an info line is never held back", at=Level.INFO))
    assert seen == ["cannot reach http://127.0.0.1:9 (connection refused)"] + [
        "could not read the balance: an info line is never held back"] * 2
    pipeline._flush_repeats()
    assert seen[-1] == "cannot reach http://127.0.0.1:9 (connection refused) (and 29 more like it within 30 s)"


# -- 5. screens that fit ------------------------------------------------------------------------

async def test_refused_keys_in_attach_show_one_toast_not_a_stack() -> None:
    from draftgen.tui.app import DraftgenApp
    from tests import fixtures as fx
    controls = fx.FakeControls(fx.attached(), fx.events(), read_only=True)  # type: ignore[arg-type]
    app = DraftgenApp(controls, title="draftgen", refresh_s=0.05)
    async with app.run_test() as pilot:
        await pilot.press("p", "r", "s", "m", "x")
        await pilot.pause(0.05)
        assert len(app._notifications) == 1


async def test_an_unavailable_reason_keeps_its_brackets() -> None:
    from draftgen.tui.app import DraftgenApp
    from tests import fixtures as fx
    reason = "no model to extract with: set [extract] model in sim.toml"
    controls = fx.FakeControls(fx.running(), fx.events(), unavailable={"extract": reason})  # type: ignore[arg-type]
    app = DraftgenApp(controls, title="draftgen", refresh_s=0.05)
    async with app.run_test() as pilot:
        await pilot.press("x")
        await pilot.pause(0.05)
        (note,) = list(app._notifications)
        assert note.message == reason and not note.markup


# -- 4. one set of figures ----------------------------------------------------------------------

def _ended_with(costs: tuple[float, ...], this_run: float, all_runs: float, runs: int = 1):  # noqa: ANN202
    import dataclasses

    from draftgen.core.live import snapshot as snap
    from tests import fixtures as fx
    s = fx.ended(snap.RunState.DONE)
    datasets = tuple(dataclasses.replace(d, cost_usd=c) for d, c in zip(s.datasets, costs))
    timeline = dataclasses.replace(s.timeline, runs=tuple(range(runs)))
    credits = dataclasses.replace(s.credits, spent_usd=this_run, spent_total_usd=all_runs)
    return dataclasses.replace(s, datasets=datasets[:len(costs)], credits=credits, timeline=timeline)


def test_the_total_row_is_the_sum_of_its_rows_and_the_rest_is_named() -> None:
    from draftgen.core.live.summary import summary_lines
    block = summary_lines(_ended_with((0.204, 0.204), 0.408, 0.43), 0)
    rows = [x for x in block if x.startswith("  ") and " answered " in x]
    assert " $0.20" in rows[0] and " $0.20" in rows[1]
    assert rows[-1].startswith("  total") and rows[-1].rstrip().endswith("$0.40")
    text = "\n".join(block)
    assert "(answers $0.40, smoke tests and unanswered attempts $0.03)" in text and all(len(x) <= 120 for x in block)


def test_a_first_run_does_not_say_all_runs() -> None:
    from draftgen.core.live.summary import summary_lines
    text = "\n".join(summary_lines(_ended_with((0.00163,), 0.00163, 0.11), 0))
    assert "all runs" not in text and "spent $0.00163 this run, $0.11 in all" in text
    again = "\n".join(summary_lines(_ended_with((0.00163,), 0.00163, 0.11, runs=3), 0))
    assert "$0.11 all runs of the directory" in again


def test_the_eta_waits_until_it_is_stable_and_is_never_0_while_work_remains() -> None:
    from draftgen.core.generate.loop.projection import stable_eta
    kw = {"elapsed_s": 60.0, "window_s": 30.0, "work_left": True}
    assert stable_eta(44_340.0, answers=3, **kw) is None  # "12 h 19 min" from the first three answers
    assert stable_eta(44_340.0, answers=500, elapsed_s=10.0, window_s=30.0, work_left=True) is None
    assert stable_eta(0.0, answers=500, **kw) is None  # "ETA 0 s" with a dataset at 47 %
    assert stable_eta(120.0, answers=500, **kw) == 120.0
    assert stable_eta(0.0, answers=500, elapsed_s=60.0, window_s=30.0, work_left=False) == 0.0


def _panel_text(app, selector: str) -> str:  # noqa: ANN001 - what a Static panel shows, as plain text
    from rich.console import Console
    widget = app.screen.query_one(selector)
    console = Console(width=widget.content_region.width, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(widget.content)
    return cap.get()


async def test_pending_spend_is_not_clipped_at_120x40() -> None:
    import dataclasses

    from draftgen.tui.app import DraftgenApp
    from tests import fixtures as fx
    s = fx.running()
    s = dataclasses.replace(s, credits=dataclasses.replace(s.credits, pending_usd=0.02))
    app = DraftgenApp(fx.FakeControls(s, fx.events()), title="draftgen", refresh_s=0.05)  # type: ignore[arg-type]
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.1)
        shown = _panel_text(app, "#credits")
    assert "$0.02 pending" in shown and "…" not in shown


@pytest.mark.parametrize("runs", [1, 3])
async def test_the_attach_header_keeps_the_run_name_at_80x24(runs: int) -> None:
    import dataclasses

    from draftgen.tui.app import DraftgenApp
    from tests import fixtures as fx
    s = fx.attached()
    s = dataclasses.replace(s, timeline=dataclasses.replace(s.timeline, runs=tuple(range(runs))),
                            first_started_at=s.first_started_at or 1.0)
    app = DraftgenApp(fx.FakeControls(s, fx.events(), read_only=True), title="draftgen", refresh_s=0.05)  # type: ignore[arg-type]
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.1)
        header = _panel_text(app, "#header")
    assert "ATTACHED" in header and s.run_name in header, header


async def test_a_dataset_done_line_shows_the_ledger_cost_in_the_one_money_format(tmp_path: Path) -> None:
    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.live.events import EventKind, Payload
    from draftgen.core.live.payloads import DatasetDone
    from draftgen.core.units import usd
    async with SimServer(SimConfig(seed=1, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "max_tokens": 200}],
                          tables={"engine": {"reconstruct": False}})
        events: list[tuple[str, str, str, Payload]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p:
                        events.append((p.level, p.kind, p.text(), p)))
        await engine.run()
    (done,) = [(m, data) for _, kind, m, data in events if kind == EventKind.DATASET_DONE]
    assert done[0].endswith(", " + usd(engine.spend.by_dataset["a"])), done
    assert isinstance(done[1], DatasetDone) and done[1].cost_usd == engine.spend.by_dataset["a"]
    assert (done[1].answered, done[1].total, done[1].failed) == (3, 3, 0)


def test_a_token_budget_overshoot_is_said_in_the_summary() -> None:
    import dataclasses

    from draftgen.core.live.summary import summary_lines
    s = _ended_with((0.2,), 0.2, 0.2)
    d = dataclasses.replace(s.datasets[0], token_budget=100_000, tokens_used=105_700)
    text = "\n".join(summary_lines(dataclasses.replace(s, datasets=(d,)), 0))
    assert f"{d.name}: 5,700 completion tokens past its token budget of 100,000 (5.7%): answers already" in text


def test_an_error_naming_a_path_shows_its_controls_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The one place errors are printed (cli/main.py): a path, a file's line or a server's words in the message
    reach the terminal with their controls as visible escapes."""
    from draftgen.cli.main import main
    assert main(["report", str(tmp_path / "runs\x1b]0;pwned\x07\u202e")]) == 2
    err = capsys.readouterr().err
    assert "runs\\x1b]0;pwned\\x07\\u202e: no such run directory" in err and "\x1b" not in err, err
