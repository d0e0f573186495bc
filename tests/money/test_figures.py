"""One set of figures, one voice for messages: every cost column from the spend
ledger in merge and report, one money formatter, the headless ETA, events that do not fit, and the
"cannot reach" warning."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from draftgen.core.merge.command import merge_command
from draftgen.core.merge.merge import merge
from tests.merge.test_merge import Sample, user, write_dataset
from tests.merge.test_merge import make_config as merge_config

# -- cost columns from the ledger ---------------------------------------------------------------

def _ledger(run: Path) -> None:
    """spend.jsonl as runs leave it: answers priced from usage.cost, an answer that carried no cost
    priced later from its generation record, an abandoned attempt that was billed, a smoke request."""
    lines: list[dict[str, Any]] = []

    def attempt(aid: str, ds: str, prompt: str, *ends: dict[str, Any]) -> None:
        lines.append({"e": "sent", "a": aid, "ds": ds, "p": prompt, "w": 0.5, "t": 1.0})
        lines.append({"e": "gen", "a": aid, "g": f"gen-{aid}"})
        lines.extend({"a": aid, **end} for end in ends)

    attempt("1", "A", "a1", {"e": "end", "o": "answered", "c": 0.1, "s": "usage.cost"})
    attempt("2", "A", "a2", {"e": "end", "o": "answered", "c": None, "s": "pending", "w": 0.3},
            {"e": "settle", "c": 0.1, "s": "generation"})
    attempt("3", "A", "a3", {"e": "end", "o": "abandoned", "c": None, "s": "pending"},
            {"e": "settle", "c": 0.004, "s": "generation"})
    attempt("4", "B", "b1", {"e": "end", "o": "answered", "c": 0.204, "s": "usage.cost"})
    attempt("5", "(smoke)", "smoke:A", {"e": "end", "o": "answered", "c": 0.03, "s": "usage.cost"})
    (run / "spend.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))


@pytest.fixture
def ledgered(tmp_path: Path):  # noqa: ANN201 - a Config
    run = tmp_path / "run"
    # a2's record carries no cost (the ledger priced it later); a3 was abandoned, so it has no record.
    write_dataset(run, "A", [Sample("a1", user("one"), cost=0.1), Sample("a2", user("two"), cost=0.0)], seed=1)
    write_dataset(run, "B", [Sample("b1", user("three"), cost=0.204)], seed=2)
    write_dataset(run, "C", [Sample("c1", user("four"), cost=0.002)], seed=3)  # no ledger line: usage.cost
    _ledger(run)
    return merge_config(tmp_path, seed=1)


def test_merge_costs_are_the_ledgers(ledgered, capsys: pytest.CaptureFixture[str]) -> None:
    stats = merge(ledgered)
    by = {d.name: d for d in stats.datasets}
    assert by["A"].cost_usd == pytest.approx(0.2) and by["A"].cost_all_usd == pytest.approx(0.204)
    assert by["B"].cost_all_usd == pytest.approx(0.204) and by["C"].cost_all_usd == pytest.approx(0.002)
    on_disk = {d["name"]: d
               for d in orjson.loads((ledgered.run_dir / "merged" / "stats.json").read_bytes())["datasets"]}
    assert on_disk["A"]["cost_all_usd"] == pytest.approx(0.204)
    merge_command(ledgered)
    out = capsys.readouterr().out
    row = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()
           if line.count("│") >= 8}
    # The dataset's figure as the run's summary shows it; the total is the sum of the rows as shown.
    assert row["A"][-2:] == ["$0.20", "$0.20"] and row["B"][-1] == "$0.20" and row["C"][-1] == "$0.00200"
    assert row["total"][-1] == "$0.40", out


def test_report_costs_are_the_ledgers_and_add_up(ledgered) -> None:
    from draftgen.tui.report import report
    out = io.StringIO()
    report(ledgered.run_dir, out=out, width=120)
    text = out.getvalue()
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split()[:1] in (["A"], ["B"], ["total"])}
    assert rows["A"][-1] == "$0.20" and rows["B"][-1] == "$0.20", text
    assert rows["total"][-1] == "$0.40", text  # the rows as shown (0.204 + 0.204 would round to $0.41)
    assert "spent $0.44 in all" in text and "smoke tests and unanswered attempts $0.04" in text, text


# -- one money formatter -------------------------------------------------------------------------

def _running(**throughput: object):  # noqa: ANN202 - a RunSnapshot
    import dataclasses

    from tests import fixtures as fx
    s = fx.running()
    return dataclasses.replace(s, throughput=dataclasses.replace(s.throughput, **throughput))


def test_the_headless_line_shows_money_in_the_one_format() -> None:
    import dataclasses

    from draftgen.core.units import usd
    from draftgen.headless.printer import detail_lines, status_line
    s = _running()
    s = dataclasses.replace(s, credits=dataclasses.replace(s.credits, max_usd=130.0))
    line = status_line(s, now=0.0)
    assert f"rsv/{usd(130.0)} " in line and usd(130.0) == "$130.00", line  # was "$130" here, "$130.00" below
    assert f"ceiling {usd(130.0)}" in "\n".join(detail_lines(s))


async def test_the_run_done_line_uses_the_one_formatter(tmp_path: Path) -> None:
    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.units import usd
    from draftgen.simulator import SimConfig, SimServer
    from tests.helpers import TEST_KEY, make_config
    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3, "max_tokens": 200}],
                          tables={"engine": {"reconstruct": False}})
        events: list[tuple[str, str, str]] = []
        engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
        await engine.run()
    (done,) = [m for _, kind, m in events if kind == "run_done"]
    assert f"; {usd(engine.money.spent_run)} spent this run, {usd(engine.spend.spent_usd)} all runs" in done, done


def test_the_projection_reads_in_the_one_format() -> None:
    from draftgen.core.generate.money.forecast import RunForecast
    plan = RunForecast(datasets=(), spent_usd=0.004, left_usd=0.002, low_usd=0.001, high_usd=0.003, max_usd=0.0055,
                       time_s=None)  # the figures of a smoke test: fractions of a cent, shown as such
    assert plan.describe() == ("$0.00550 (range $0.00500-$0.00550), stopped by max_usd $0.00550 "
                               "before every dataset is done")


# -- the headless ETA ----------------------------------------------------------------------------

def test_the_headless_eta_is_a_dash_until_stable_and_never_0_while_work_remains() -> None:
    from draftgen.headless.printer import detail_lines, status_line
    for s in (_running(eta_s=None), _running(eta_s=0.0), _running(eta_s=0.4)):
        line = status_line(s, now=0.0)
        assert line.endswith("| ETA —"), line
        assert any(x.endswith("| ETA —") or "| ETA — |" in x for x in detail_lines(s))
    assert status_line(_running(eta_s=125.0), now=0.0).endswith("| ETA 2m05s")


async def test_the_tui_header_shows_a_dash_for_an_eta_not_yet_stable() -> None:
    from draftgen.tui.app import DraftgenApp
    from tests import fixtures as fx
    from tests.helpers import text
    for eta, shown in ((None, "ETA —"), (125.0, "ETA 2 min")):
        app = DraftgenApp(fx.FakeControls(_running(eta_s=eta), fx.events()), title="draftgen",  # type: ignore[arg-type]
                          refresh_s=0.05)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.2)
            header = text(app, "#header")
            assert shown in header, header


# -- events that do not fit ----------------------------------------------------------------------

LONG = ("B5: 412 answers in runs/B5/responses.jsonl have no line on the spend ledger of this directory "
        "(its tail lost in a crash?): their cost now counts as spent")


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_an_event_that_does_not_fit_is_cut_at_a_word_and_shown_whole_wrapped_under_its_message(size) -> None:
    from draftgen.tui.app import DraftgenApp
    from draftgen.tui.panels.eventlog import EventLogPanel
    from tests import fixtures as fx
    events = (*fx.events(), fx.event(fx.T0 + 2_400, "warn", "unledgered", LONG),
              fx.event(fx.T0 + 2_401, "info", "credits", "balance $63.90"))
    app = DraftgenApp(fx.FakeControls(fx.running(), events), title="draftgen", refresh_s=0.05)  # type: ignore[arg-type]
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.1)
        log = app.screen.query_one(EventLogPanel)
        width = log.scrollable_content_region.width
        n = len(log._shown)
        cut = str(log.get_option_at_index(n - 2).prompt)
        # One line, cut after a whole word of the message, marked "…".
        assert "\n" not in cut and cut.endswith("…") and len(cut) <= width, cut
        assert LONG.startswith(cut[15:-1]) and LONG[len(cut[15:-1])] in " ", cut
        log.highlighted = n - 2
        await pilot.pause(0.05)
        whole = str(log.get_option_at_index(n - 2).prompt).split("\n")
    # Whole: every line fits, every line after the first starts under the message, no word is split.
    assert len(whole) > 1 and all(len(x) <= width for x in whole), whole
    assert all(x.startswith(" " * 15) and x[15] != " " for x in whole[1:]), whole
    assert " ".join(x.strip() for x in [whole[0][15:], *whole[1:]]) == LONG


# -- the "cannot reach" warning ------------------------------------------------------------------

@pytest.mark.parametrize(("base_url", "cause", "says", "not_says"), [
    ("https://openrouter.ai/api/v1", "cannot connect to openrouter.ai:443 (name or service not known)",
     "check this machine's network and DNS", "base_url"),
    ("https://openrouter.ai/api/v1", "cannot connect to https://openrouter.ai/api/v1: no answer within 10 s",
     "check this machine's network", "base_url"),
    ("http://gpu-box:8000/v1", "cannot connect to gpu-box:8000 (temporary failure in name resolution)",
     "the host name in [api] base_url (http://gpu-box:8000/v1)", "server is up"),
    ("http://127.0.0.1:9/v1", "cannot connect to 127.0.0.1:9 (connection refused)",
     "check [api] base_url (http://127.0.0.1:9/v1) and that the server is up", "network"),
    ("https://127.0.0.1:9/v1", "cannot connect to 127.0.0.1:9 (TLS handshake failed: wrong version number)",
     "https:// for a TLS server, http:// for a plain one", "network"),
])
def test_unreachable_advice_matches_the_cause(base_url: str, cause: str, says: str, not_says: str) -> None:
    from draftgen.core.generate.api.classify import unreachable_advice
    advice = unreachable_advice(base_url, cause)
    assert says in advice and not_says not in advice and "press" not in advice, advice


async def test_the_unreachable_warning_says_its_cause_once_with_advice_that_fits_headless(tmp_path: Path) -> None:
    import asyncio

    from draftgen.core.generate.loop.engine import Engine
    from draftgen.simulator import SimConfig, SimServer
    from tests.helpers import TEST_KEY, make_config
    async with SimServer(SimConfig(seed=1), port=0) as sim:
        port = sim.port  # closed again: nothing listens there
    cfg = make_config(tmp_path, f"http://127.0.0.1:{port}/api/v1", [{"name": "a", "n": 2}],
                      tables={"engine": {"reconstruct": False, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
                              "api": {"prompt_price_per_mtok": 1.0, "completion_price_per_mtok": 4.0}})
    events: list[tuple[str, str, str]] = []
    engine = Engine(cfg, TEST_KEY, seed=1, on_event=lambda p: events.append((p.level, p.kind, p.text())))
    task = asyncio.create_task(engine.run())
    waiting = ""
    for _ in range(500):
        await asyncio.sleep(0.02)
        waiting = engine.snapshot().waiting
        if waiting and any(kind == "unreachable" for _, kind, _ in events):
            break
    engine.drain()
    await asyncio.wait_for(task, 30)
    (warning,) = [m for _, kind, m in events if kind == "unreachable"]
    cause = f"cannot connect to 127.0.0.1:{port} (connection refused)"
    assert warning.startswith(f"{cause}: check [api] base_url (http://127.0.0.1:{port}/api/v1) in {cfg.path} and "
                              "that the server is up; retrying until it answers"), warning
    for text in (warning, waiting):
        assert text.count(str(port)) == (text.count("base_url (") + 1) and "cannot reach" not in text, text
        assert "press" not in text, text
    assert waiting.startswith(f"{cause} for ") and "(check [api] base_url" in waiting, waiting


async def test_the_ledger_says_once_which_request_could_not_reach_the_server(tmp_path: Path) -> None:
    """`draftgen ledger` with the server gone (the demo's simulator after the demo): the table is printed and
    the key's usage line names GET /key and its cause once, not twice."""
    from draftgen.core.generate.money.reconcile import reconcile
    from draftgen.simulator import SimConfig, SimServer
    from tests.helpers import TEST_KEY, make_config
    async with SimServer(SimConfig(seed=1), port=0) as sim:
        port = sim.port  # closed again: nothing listens there
    cfg = make_config(tmp_path, f"http://127.0.0.1:{port}/api/v1", [{"name": "a", "n": 2}])
    report = await reconcile(cfg, TEST_KEY, lookup_s=0)
    assert report.key_usage_usd is None
    assert report.key_note == f"GET /key: cannot connect to 127.0.0.1:{port} (connection refused)", report.key_note
