"""The TUI driven by its keys through `App.run_test()`, on the deterministic fake control surface.

Over 400 lines: every key and screen of the app, on one fake control surface and its fixtures.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

import pytest
from rich.console import Console

from draftgen.core.live import snapshot as snap
from draftgen.tui import fmt
from draftgen.tui.app import DraftgenApp
from draftgen.tui.screens.drill import DATASET, DrillScreen, Target
from draftgen.tui.screens.help import HelpScreen
from draftgen.tui.screens.history import HistoryScreen
from draftgen.tui.screens.logview import LogScreen
from draftgen.tui.screens.quitdialog import QuitScreen
from draftgen.tui.screens.smoke import SmokeScreen
from tests import fixtures as fx
from tests.helpers import text

pytestmark = pytest.mark.usefixtures("utc")


def make(snapshot: snap.RunSnapshot | None = None, **kw: object) -> tuple[DraftgenApp, fx.FakeControls]:
    controls = fx.FakeControls(fx.running() if snapshot is None else snapshot, fx.events(), **kw)  # type: ignore[arg-type]
    return DraftgenApp(controls, title="draftgen", refresh_s=0.05), controls


async def until(pilot, cond: Callable[[], bool], what: str) -> None:
    """Let the app's refresh timer run until `cond` holds (a hang guard, not a timing check)."""
    for _ in range(400):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"never happened: {what}")


async def test_running_view_shows_the_snapshot() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        header = text(app, "#header")
        assert "RUNNING" in header and "kimi-k25-eagle3" in header and "moonshotai/kimi-k2.5" in header
        assert "elapsed 0:39:28" in header and "ETA 32 min" in header
        datasets = text(app, "#datasets")
        for name in ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8"):
            assert f"\n{name} " in "\n" + datasets
        assert "1,891/10,002" in datasets and "8,111" in datasets and "$15.12" in datasets
        throughput = text(app, "#throughput")
        # The window of every rate is named in its column header.
        assert "last 30 s" in throughput and "since start" in throughput
        assert "5,312" in throughput and "5,248" in throughput
        assert "in flight 460, limit 460 of 500" in throughput
        assert "$64.15 (42 s)" in text(app, "#credits")  # its age beside it, nothing cut
        assert "429 rate limited" in text(app, "#errors") and "43" in text(app, "#errors")
        assert "novita/int4" in text(app, "#providers")
        log = app.query_one("#events").lines  # type: ignore[attr-defined]
        assert log[-1] == "10:38:46 info  balance $64.15"
        assert not app.query_one("#alert").display
        assert not app.query_one("#lower").display  # no stage has started


async def test_pause_and_resume_call_controls_and_header_follows() -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.press("p")
        assert controls.calls == ["pause"]
        await until(pilot, lambda: "PAUSED" in text(app, "#header"), "header shows PAUSED")
        assert "paused" in text(app, "#datasets")
        await pilot.press("r")
        assert controls.calls == ["pause", "resume"]
        await until(pilot, lambda: "RUNNING" in text(app, "#header"), "header shows RUNNING")
        log = app.query_one("#events").lines  # type: ignore[attr-defined]
        assert any("resumed" in line for line in log)


async def test_smoke_opens_checklist_that_fills_in() -> None:
    app, controls = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("s")
        assert controls.calls == ["smoke"]
        assert isinstance(app.screen, SmokeScreen)
        await until(pilot, lambda: "running…" in text(app, "#smoke-body"), "smoke running")
        body = text(app, "#smoke-body")
        assert "API key" in body and "requests" in body and "reasoning" not in body
        controls.publish(fx.smoke())  # the engine finishes the checks
        await until(pilot, lambda: "PASSED" in text(app, "#smoke-body"), "smoke passed")
        body = text(app, "#smoke-body")
        assert body.count("✓ pass") == len(fx.SMOKE_CHECKS)
        assert "$0.00047" in body
        await pilot.press("escape")
        assert not isinstance(app.screen, SmokeScreen)


async def test_failed_smoke_check_shows_its_reason() -> None:
    app, controls = make()
    failed = dataclasses.replace(fx.smoke(), stages=(snap.StageProgress(
        name="smoke", state="failed", checks=(("API key", True, "valid"),
                                              ("provider", False, "fireworks served FP4 tokens")),
        message="1 check failed: the run stays paused"),))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("s")
        controls.publish(failed)
        await until(pilot, lambda: "FAILED" in text(app, "#smoke-body"), "smoke failed")
        body = text(app, "#smoke-body")
        assert "✗ FAIL" in body and "fireworks served FP4 tokens" in body and "stays paused" in body


async def test_quit_stop_now_exits_at_once() -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        assert controls.calls == []
        await pilot.press("s")
        assert controls.calls == ["quit:stop"]
        await until(pilot, lambda: not app.is_running, "app exits")


async def test_quit_drain_waits_for_the_run_to_stop() -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.press("q", "d")
        assert controls.calls == ["quit:drain"]
        # Draining: the app stays up while the requests in flight finish...
        await until(pilot, lambda: "DRAINING" in text(app, "#header"), "header shows DRAINING")
        assert app.is_running
        # ...q again offers the choice once more; the app leaves when the engine says it stopped.
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("escape")
        controls.publish(dataclasses.replace(controls.latest, state=snap.RunState.STOPPED, seq=999))
        await until(pilot, lambda: not app.is_running, "app exits")
        assert controls.calls == ["quit:drain"]


async def test_quit_asked_during_extraction_says_so_and_what_is_left_once_it_ends() -> None:
    """q while a later stage runs names that stage; if everything ends while the question is open, the
    question says so (no "generation is running") and either key just exits."""
    busy = fx.extracting()
    app, controls = make(busy)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("q")
        assert isinstance(app.screen, QuitScreen)
        assert "Extraction is running (6,000 of 15,088 files)" in " ".join(text(app, "#quit-text").split())
        extract = dataclasses.replace(busy.stages[-1], state="done", done=15_088)
        controls.publish(dataclasses.replace(busy, seq=busy.seq + 1, state=snap.RunState.DONE,
                                             stages=(*busy.stages[:-1], extract)))
        await until(pilot, lambda: "has ended" in text(app, "#quit-text"), "the question follows the run")
        said = " ".join(text(app, "#quit-text").split())
        assert "The run has ended (DONE) and nothing is running" in said and "generation" not in said.lower()
        await pilot.press("d")
        assert controls.calls == ["quit:drain"]
        await until(pilot, lambda: not app.is_running, "app exits")


async def test_quit_cancel_keeps_running() -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.press("q")
        await pilot.press("escape")
        assert not isinstance(app.screen, QuitScreen)
        assert controls.calls == [] and app.is_running and not app.quit_requested
        await pilot.press("q", "tab", "tab", "enter")  # keyboard focus on "Cancel": same
        assert controls.calls == [] and app.is_running


async def test_quit_after_the_run_ended_does_not_ask() -> None:
    app, controls = make(dataclasses.replace(fx.running(), state=snap.RunState.DONE))
    async with app.run_test() as pilot:
        await pilot.press("q")
        assert controls.calls == ["quit:drain"]
        await until(pilot, lambda: not app.is_running, "app exits")


async def test_help_opens_and_closes() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("p")  # control keys belong to the main screen, not the help
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_merge_and_extract_start_their_stages() -> None:
    app, controls = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("m")
        assert controls.calls == ["merge"]
        await until(pilot, lambda: app.query_one("#stages").display, "stages panel shown")
        assert "merge" in text(app, "#stages") and "9,400/15,157" in text(app, "#stages")
        assert not app.query_one("#gpu").display
        await pilot.press("x")
        assert controls.calls == ["merge", "extract"]
        await until(pilot, lambda: app.query_one("#gpu").display, "GPU panel shown")
        gpu = text(app, "#gpu")
        assert "0 H200" in gpu and "1 H200" in gpu and "97%" in gpu and "612 W" in gpu and "64°C" in gpu


async def test_merge_over_hidden_states_asks_first_and_cancel_changes_nothing() -> None:
    from draftgen.tui.screens.choice import ChoiceScreen
    app, controls = make()
    controls.merge_asks = "hidden_states/ holds the hidden states of merge 0123456789abcdef (338 samples)."
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("m")
        assert isinstance(app.screen, ChoiceScreen) and controls.calls == []
        assert "merge 0123456789abcdef" in text(app, "#choice-text") and "set aside" in text(app, "#choice-text")
        await pilot.press("escape")
        assert not isinstance(app.screen, ChoiceScreen) and controls.calls == []
        await pilot.press("m", "m")  # merge anyway: hidden states of another merge are set aside
        assert controls.calls == ["merge:replace"]


async def test_extract_over_another_merge_offers_start_over_or_set_aside() -> None:
    from draftgen.tui.screens.choice import ChoiceScreen
    app, controls = make()
    controls.extract_asks = "hidden_states/ holds 338 files of merge aaaa, but merged/ is merge bbbb (seed 1 -> 2)."
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("x")
        assert isinstance(app.screen, ChoiceScreen) and controls.calls == []
        body = text(app, "#choice-text")
        assert "seed 1 -> 2" in body and "start over" in body and "set aside" in body
        await pilot.press("escape")
        assert controls.calls == []
        await pilot.press("x", "a")
        assert controls.calls == ["extract:set_aside"]
        await pilot.press("x")
        await pilot.click("#choice-start_over")
        assert controls.calls == ["extract:set_aside", "extract:start_over"]


async def test_gpu_panel_shows_one_devices_error_on_its_row_and_cuda_numbering() -> None:
    gpus = (snap.GpuStat(index=0, name="NVIDIA H200", util_pct=88.0, mem_used_mb=100_000.0, mem_total_mb=143_771.0,
                    power_w=600.0, temp_c=60.0, physical=3),
            snap.GpuStat(index=1, name="NVIDIA H200", util_pct=0.0, mem_used_mb=0.0, mem_total_mb=0.0,
                    power_w=None, temp_c=None, physical=5, error="GPU is lost"))
    app, _ = make(dataclasses.replace(fx.extracting(), gpus=gpus))
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.query_one("#gpu").display, "GPU panel shown")
        gpu = text(app, "#gpu")
        assert "0→3 H200" in gpu and "88%" in gpu and "600 W" in gpu
        assert "1→5 H200" in gpu and "NVML error" in gpu and "GPU 1→5: NVML: GPU is lost" in gpu


async def test_extraction_without_nvml_says_no_gpu() -> None:
    app, _ = make(dataclasses.replace(fx.extracting(), gpus=None))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.query_one("#gpu").display
        assert "no GPU" in text(app, "#gpu")


async def test_unavailable_stage_says_why_instead() -> None:
    reason = "merge needs finished datasets: B5 is still running"
    app, controls = make(unavailable={"merge": reason, "extract": "extraction needs merged/ first"})
    notes: list[str] = []
    async with app.run_test() as pilot:
        app.notify = lambda message, **kw: notes.append(message)  # type: ignore[method-assign]
        await pilot.press("m", "x")
        assert controls.calls == []
        assert notes == [reason, "extraction needs merged/ first"]
        assert not app.query_one("#stages").display


async def test_read_only_control_keys_say_so_and_leave_the_footer() -> None:
    app, controls = make(fx.attached(), read_only=True)
    notes: list[str] = []
    async with app.run_test() as pilot:
        app.notify = lambda message, **kw: notes.append(message)  # type: ignore[method-assign]
        assert "ATTACHED read-only" in text(app, "#header")
        shown = {b.binding.action for b in app.active_bindings.values() if b.enabled and b.binding.show}
        assert not shown & {"pause", "resume", "smoke", "merge", "extract"}  # the footer shows only keys that work
        assert {"log", "history", "quit_run", "help"} <= shown
        await pilot.press("p", "r", "s", "m", "x")
        assert controls.calls == []
        assert len(notes) == 5 and all(n.startswith("read-only: attached viewer") for n in notes)
        assert len(app.screen_stack) == 1
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "q")  # q closes the viewer only
        await until(pilot, lambda: not app.is_running, "viewer exits")
        assert controls.calls == []


async def test_alert_bar_shows_402() -> None:
    app, controls = make(fx.out_of_credits())
    async with app.run_test() as pilot:
        await pilot.pause()
        assert app.query_one("#alert").display
        assert "402 Payment Required" in text(app, "#alert")
        await pilot.press("r")  # the fake engine clears the alert on resume
        await until(pilot, lambda: not app.query_one("#alert").display, "alert cleared")


async def test_alert_bar_says_why_the_run_waits_through_an_outage() -> None:
    why = "cannot connect to 127.0.0.1:18799 (connection refused) for 12 s; retrying until it answers"
    app, _ = make(dataclasses.replace(fx.running(), waiting=why))
    async with app.run_test() as pilot:
        await pilot.pause()
        assert app.query_one("#alert").display
        assert "WAITING: cannot connect to 127.0.0.1:18799" in text(app, "#alert")


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 50)], ids=["80", "120", "200"])
async def test_the_limit_cut_by_a_storm_shows_its_configured_value_whole(size: tuple[int, int]) -> None:
    """1,780 of 2,000 (the widest counts) at the panel's own width: nothing cut ("limit 1,780 o…" was)."""
    app, _ = make(fx.backed_off())
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        widget = app.screen.query_one("#throughput")
        console = Console(width=widget.content_region.width, file=io.StringIO(), color_system=None)
        with console.capture() as cap:
            console.print(widget.content)  # type: ignore[attr-defined]
        shown, rows = cap.get(), widget.content_region.height
    assert "in flight 1,780" in shown and "limit 1,780 of 2,000" in shown, shown
    assert "…" not in shown, shown
    assert len(shown.splitlines()) <= rows, shown  # every line on screen (a short one gives up the sparkline)


async def test_80x24_keeps_every_panel_on_screen() -> None:
    app, _ = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for selector in ("#header", "#datasets", "#throughput", "#credits", "#errors", "#providers", "#events",
                         "Footer"):
            region = app.query_one(selector).region
            assert region.height > 0 and region.right <= 80 and region.bottom <= 24, selector
        datasets = text(app, "#datasets")
        assert "B8" in datasets and "$15.05" in datasets
        throughput = text(app, "#throughput")
        assert "last 30 s" in throughput and "since start" in throughput
        credits = text(app, "#credits")
        assert "$64.15 (42 s)" in credits and "$65.85 run" in credits  # nothing cut at 80 columns
        assert "…" not in credits


async def test_no_color_still_says_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    app, _ = make(fx.paused())
    assert app.no_color
    async with app.run_test() as pilot:
        await pilot.pause()
        assert "PAUSED" in text(app, "#header")
        assert "░" in text(app, "#datasets")  # progress bars read without colour


async def test_only_the_newest_snapshot_is_drawn() -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.pause()
        app.refresh_s = 3600  # hold the timer back while the engine outruns the screen
        await pilot.pause(0.1)
        drawn: list[int] = []
        draw = app.render_snapshot
        app.render_snapshot = lambda s: (drawn.append(s.seq), draw(s))[-1]  # type: ignore[method-assign]
        for i in range(500):
            controls.publish(dataclasses.replace(fx.running(), seq=1000 + i, elapsed_s=3_000.0 + i))
        app.pull()
        assert drawn == [1499], f"{len(drawn)} snapshots drawn, not only the newest"
        assert app.latest is not None and app.latest.seq == 1499
        assert "elapsed 0:58:19" in text(app, "#header")


async def test_panel_skips_unchanged_slices() -> None:
    app, _ = make()
    async with app.run_test() as pilot:
        await pilot.pause()
        header, datasets = app.query_one("#header"), app.query_one("#datasets")
        later = dataclasses.replace(fx.running(), seq=500, elapsed_s=9_999.0)
        assert header.show(later)  # type: ignore[attr-defined]
        assert not datasets.show(later)  # type: ignore[attr-defined]  # datasets unchanged: no render


def test_number_formats() -> None:
    assert [fmt.tokens(n) for n in (950, 12_345, 9_996_000, 10_000_000)] == ["950", "12.3k", "9.99M", "10.0M"]
    assert fmt.usd(0.00047) == "$0.00047" and fmt.usd(86.4) == "$86.40" and fmt.usd(None) == "—"
    assert fmt.duration(42) == "42 s" and fmt.duration(1_890) == "32 min" and fmt.duration(7_500) == "2 h 05 min"
    assert fmt.clock(2_368) == "0:39:28"
    # Zero-based: a steady rate is a flat line, not noise blown up to full height.
    assert fmt.sparkline([3.5, 3.6, 3.6], 10) == "███"
    assert fmt.sparkline([1.0, 2.0, 4.0], 10) == "▂▄█"
    assert fmt.sparkline([0, 1, 2, 4], 3) == "▂▄█"  # the newest that fit; a zero is blank


async def test_providers_panel_shows_token_agreement_and_the_flag() -> None:
    fidelity = (snap.ProviderFidelity("novita/int4", 3_512, 0.97, 1.0),
                snap.ProviderFidelity("parasail/int4", 2_790, 0.02, 0.0,
                                      "answer token counts exact in 2% of 2,790 answers against 97%"))
    app, _ = make(dataclasses.replace(fx.running(), fidelity=fidelity))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(app, "#providers")
        assert "exact 97%" in shown and "! exact 2%" in shown
        assert "together/int4" in shown  # no figures yet: listed without them


async def test_providers_panel_shows_each_fleet_servers_own_limit() -> None:
    """A fleet's servers are the providers' rows, each with its own adaptive limit after its share."""
    names = ("http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1")
    stats = (snap.ProviderStat(names[0], answers=600, server=True, limit=34, limit_configured=100),
             snap.ProviderStat(names[1], answers=400, server=True, limit=100, limit_configured=100))
    app, _ = make(dataclasses.replace(fx.running(), providers=((names[0], 600), (names[1], 400)),
                                      provider_stats=stats, fidelity=()))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(app, "#providers")
        assert "60% ≤34" in shown and "40% ≤100" in shown, shown


# -- the operator's views: drill-down, log, history, end states, terminal sizes ------------------------


async def test_drill_into_a_dataset_shows_its_recent_errors() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.focused is app.query_one("#datasets")
        await pilot.press("j", "j", "j", "down")  # B1 -> B5
        assert app.query_one("#datasets").selected == "B5"  # type: ignore[attr-defined]
        await pilot.press("k", "j", "enter")
        assert isinstance(app.screen, DrillScreen)
        body = text(app, "#drill-body")
        assert "dataset B5" in body and "740 of 10,310" in body
        # Its recent errors, newest first, with prompt ids, kinds, providers and attempts; B3's not.
        assert body.index("b5-00951") < body.index("b5-00871") and "b3-04417" not in body
        assert "novita/int4" in body and "8 ✗" in body
        await pilot.press("escape")
        assert not isinstance(app.screen, DrillScreen)


async def test_drill_into_an_error_kind_and_a_provider() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("tab")  # datasets -> errors
        assert app.focused is app.query_one("#errors")
        await pilot.press("enter")  # the first kind: 429 rate limited
        assert isinstance(app.screen, DrillScreen)
        body = text(app, "#drill-body")
        assert "error kind 429 rate limited" in body and "37" in body
        assert "b5-00871" in body and "b5-00904" not in body  # only that kind
        await pilot.press("escape", "tab", "j", "enter")  # providers: parasail/int4
        body = text(app, "#drill-body")
        assert "provider parasail/int4" in body and "34%" in body and "p90 158.5 s" in body
        assert "answer counts exact in 96% of 2,771 reconstructed, prompt counts in 100%" in body
        assert "b5-00212" in body and "b5-00871" not in body


async def test_drill_follows_new_snapshots() -> None:
    app, controls = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("enter")  # B1 has no errors
        assert "no errors recorded" in text(app, "#drill-body")
        new = fx.RECENT_ERRORS[0].__class__(ts=fx.T0 + 2_400, kind="timeout", dataset="B1", prompt_id="b1-09999",
                                            attempt=3, message="late timeout")
        controls.publish(dataclasses.replace(fx.running(), seq=500, recent_errors=fx.RECENT_ERRORS + (new,)))
        await until(pilot, lambda: "b1-09999" in text(app, "#drill-body"), "drill-down shows the new error")


async def test_main_log_scrolls_and_stops_following_until_end() -> None:
    app, controls = make()
    async with app.run_test(size=(120, 30)) as pilot:
        log = app.query_one("#events")
        await pilot.pause()
        assert log.following and log.highlighted == len(fx.events()) - 1  # type: ignore[attr-defined]
        await pilot.press("pageup")  # works from the main screen without focusing the log
        assert not log.following and log.highlighted < len(fx.events()) - 1  # type: ignore[attr-defined]
        assert "scrolled" in str(log.border_title)
        controls.event("info", "x", "a new event while scrolled up")
        await until(pilot, lambda: log.option_count == len(fx.events()) + 1, "new event listed")  # type: ignore[attr-defined]
        assert log.highlighted < log.option_count - 1  # type: ignore[attr-defined]  # did not jump to the tail
        await pilot.press("end")
        assert log.following and log.highlighted == log.option_count - 1  # type: ignore[attr-defined]
        await pilot.press("home")
        assert log.highlighted == 0 and not log.following  # type: ignore[attr-defined]
        await pilot.press("pagedown")
        assert log.highlighted > 0  # type: ignore[attr-defined]


async def test_log_view_filters_by_level_and_dataset_and_searches() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        log = app.screen.events_log
        assert len(log.lines) == len(fx.events())
        await pilot.press("v")  # warnings and errors
        assert len(log.lines) == 2 and all(" warn " in line for line in log.lines)
        await pilot.press("v", "v", "d")  # back to every level; then the first dataset, B1
        assert log.dataset == "B1" and all(" B1: " in line for line in log.lines) and len(log.lines) == 3
        await pilot.press("c", "slash")
        await pilot.press(*"balance", "enter")
        assert [line.split(" ", 2)[2].strip() for line in log.lines] == ["balance $96.20", "balance $64.15"]
        assert "/balance" in str(log.border_title)
        await pilot.press("escape")
        assert not isinstance(app.screen, LogScreen)


@pytest.mark.parametrize("view", ["log", "history", "drill"])
async def test_a_snapshot_that_comes_while_a_view_is_being_composed_is_shown_once_it_is_up(view: str) -> None:
    """A key pushes a view; the refresh tick can come before its widgets exist (seen under load). The
    snapshot is not lost (nor the app crashed on the missing header): the view shows it once composed."""
    app, controls = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        later = dataclasses.replace(controls.latest, elapsed_s=2_400.0, seq=101)
        pushed = {"log": lambda: LogScreen(app.events, ()), "history": lambda: HistoryScreen(app.latest),
                  "drill": lambda: DrillScreen(Target(DATASET, "B1"), app.latest)}[view]()
        app.push_screen(pushed)
        assert app.screen is pushed and not pushed.is_mounted
        controls.publish(later)
        app.pull()  # the tick, in the same turn of the loop as the key
        await until(pilot, lambda: pushed.is_mounted and "elapsed 0:40:00" in text(app, "#header"),
                    "the view's header shows it")
        assert app.screen is pushed


async def test_slash_opens_the_log_searching() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("slash")
        # Typing before the search box has the focus would send the letters to the log's own keys.
        await until(pilot, lambda: isinstance(app.screen, LogScreen)
                    and app.screen.query_one("#log-search").has_focus, "the search box has the focus")
        await pilot.press(*"429s", "enter")
        await until(pilot, lambda: len(app.screen.events_log.lines) == 1, "only the 429 line is left")


async def test_selected_log_line_shows_its_full_text() -> None:
    long = "B5: " + "a long message that does not fit on one line of an 80-column terminal " * 3 + "END"
    app, controls = make()
    async with app.run_test(size=(80, 24)) as pilot:
        controls.event("error", "x", long)
        await pilot.press("l")

        def shown() -> str:
            console = Console(width=80, file=io.StringIO(), color_system=None)
            with console.capture() as cap:
                console.print(app.screen._compositor.render_update(full=True))
            return cap.get()

        await until(pilot, lambda: "END" in shown(), "the highlighted (newest) line is shown whole")
        await pilot.press("up")
        await until(pilot, lambda: "END" not in shown(), "once not highlighted, cut to one line")
        assert "…" in shown()


async def test_history_view_draws_every_chart() -> None:
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("h")
        assert isinstance(app.screen, HistoryScreen)
        body = text(app, "#history-body")
        for title in ("requests/s", "completion tokens/s", "spend per minute", "errors, % of attempts",
                      "requests in flight"):
            assert title in body
        assert "peak 6.5%" in body and "10:00" in body and "10:39" in body and "█" in body
        await pilot.press("h")
        assert not isinstance(app.screen, HistoryScreen)


async def test_wide_screen_shows_history_beside_the_tables() -> None:
    app, _ = make()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        mini = app.query_one("#mini-history")
        assert mini.display and mini.region.width > 40
        assert "requests/s" in text(app, "#mini-history")
    app, _ = make()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.query_one("#mini-history").region.width == 0


async def test_below_80x24_one_line_says_so() -> None:
    app, _ = make()
    async with app.run_test(size=(70, 20)) as pilot:
        await pilot.pause()
        notice = app.query_one("#too-small")
        assert notice.display and notice.region.height == 1
        assert "70×20" in text(app, "#too-small") and "80×24" in text(app, "#too-small")
        assert app.query_one("#body").region.height == 0
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: app.query_one("#body").region.height > 0, "panels back at 80x24")


@pytest.mark.parametrize("key", ["ctrl+c", "ctrl+q"])
async def test_ctrl_c_asks_like_q(key: str) -> None:
    app, controls = make()
    async with app.run_test() as pilot:
        await pilot.press(key)
        assert isinstance(app.screen, QuitScreen) and app.is_running and controls.calls == []
        await pilot.press("escape", "l", key)  # from a view too: back to the main screen, then the question
        assert isinstance(app.screen, QuitScreen)


@pytest.mark.parametrize("state", [snap.RunState.DRAINED, snap.RunState.STOPPED, snap.RunState.WAITING])
async def test_incomplete_end_states_say_what_is_left(state: snap.RunState) -> None:
    s = fx.ended(state)
    app, _ = make(s)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert f" {state.value} " in text(app, "#header")
        alert = text(app, "#alert")
        assert f"run {state.value}" in alert and "not asked yet" in alert and "run again" in alert
        # The account's alert stays red above the ending; otherwise the bar is the ending's colour.
        assert app.query_one("#alert").has_class("-incomplete") == (state != snap.RunState.WAITING)


async def test_done_means_nothing_left() -> None:
    app, _ = make(fx.ended(snap.RunState.DONE))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        alert = text(app, "#alert")
        assert "run DONE" in alert and ", 0 not asked yet" in alert and "run again" not in alert


def test_stage_rates_have_a_space_before_the_unit() -> None:
    from draftgen.tui.panels.stages import _row
    for unit, want in (("answers/s", "17.1 answers/s"), ("tok/s", "46,486 tok/s"), (" samples/s", "4,120 samples/s"),
                       ("/s", "3.50/s")):
        rate = {"answers/s": 17.1, "tok/s": 46_486.0, " samples/s": 4_120.0, "/s": 3.5}[unit]
        st = snap.StageProgress(name="tokens", state=snap.StageState.RUNNING, done=1, total=2, rate=rate,
                                rate_unit=unit)
        console = Console(width=120, file=io.StringIO(), color_system=None)
        with console.capture() as cap:
            console.print(_row(st))
        assert want in cap.get(), cap.get()


async def test_a_long_newest_event_is_shown_whole_at_the_bottom() -> None:
    long = "B5: " + "a long message that wraps over several rows of the events panel " * 3 + "THE END"
    app, controls = make()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        controls.event("warn", "x", long)
        log = app.query_one("#events")

        def bottom_visible() -> bool:
            console = Console(width=80, file=io.StringIO(), color_system=None)
            with console.capture() as cap:
                console.print(app.screen._compositor.render_update(full=True))
            return "THE END" in cap.get()

        await until(pilot, bottom_visible, "the whole newest event, its last row included, in view")
        assert log.following  # type: ignore[attr-defined]


async def test_a_providers_drill_shows_the_prompt_check_turn_by_turn() -> None:
    turns = (snap.TurnAgreement(1, 400, 1.0, 0.0), snap.TurnAgreement(2, 390, 0.5, -41.2),
             snap.TurnAgreement(3, 380, None, None))
    fidelity = tuple(dataclasses.replace(f, prompt_by_turn=turns) if f.name == "parasail/int4" else f
                     for f in fx.FIDELITY)
    app, _ = make(dataclasses.replace(fx.running(), fidelity=fidelity))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("tab", "tab", "j", "enter")  # providers: parasail/int4
        body = text(app, "#drill-body")
        assert "provider parasail/int4" in body
        assert "prompt by turn" in body and "1: 100% exact, 2: 50% exact (-41.2), 3: — exact" in body
        await pilot.press("escape", "k", "enter")  # novita/int4: single-turn answers only, no such row
        assert "prompt by turn" not in text(app, "#drill-body")


async def test_a_multi_turn_dataset_counts_turns_and_its_conversations_in_the_datasets_panel() -> None:
    s = fx.running()
    chat = dataclasses.replace(s.datasets[0], name="chat", total=90, done=61, conversations=30,
                               conversations_done=18, conversations_ended=2,
                               turns_by_number=((30, 30), (20, 30), (11, 30)),
                               last_conversation=("c7 (3 turns, line 8): done", "turn 1: answered", "turn 2: answered",
                                                  "turn 3: answered"))
    app, _ = make(dataclasses.replace(s, datasets=(chat, *s.datasets[1:])))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        datasets = text(app, "#datasets")
        assert "61/90" in datasets
        assert "chat: turns 61/90 answered; conversations 18/30 done, 2 ended early" in datasets, datasets
