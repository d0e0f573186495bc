"""Tests at the seam between the engine and the views: the real pipeline against the simulator's
HTTP server, its events and snapshot read by every panel of the run screen (not the hand-made
snapshots of tests/fixtures.py), the hub's drop policy, typed events and exit codes.

One real run (module fixture) with two datasets and a provider fault scenario feeds the panel tests;
each test reads what a panel draws and checks it against the run's own snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from draftgen.cli.main import EXIT_CODES
from draftgen.core.errors import DraftgenError, ExitCode, KeyRefusedError
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Event, EventKind, Level, Other
from draftgen.core.live.hub import Hub
from draftgen.core.live.payloads import Budget, CreditsRead
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from draftgen.tui import fmt
from draftgen.tui.app import DraftgenApp
from draftgen.tui.screens.drill import DrillScreen
from tests import fixtures as fx
from tests.helpers import TEST_KEY, make_config, text

# Transient provider errors (502 with metadata.provider_name) on a third of the requests: retried, so
# every prompt is answered in the end, and the errors carry the provider that failed.
SIM = SimConfig(seed=7, latency_scale=0.0, mean_completion_tokens=80, scenarios={"provider_502": {"rate": 0.3}})
DATASETS = [{"name": "alpha", "n": 24, "concurrency": 6}, {"name": "beta", "n": 16, "concurrency": 4}]
PROVIDERS = {p.name for p in SIM.providers}


@dataclasses.dataclass
class Finished:
    pipeline: Pipeline
    state: str

    @property
    def snapshot(self) -> snap.RunSnapshot:
        assert self.pipeline.hub.latest is not None
        return self.pipeline.hub.latest

    @property
    def events(self) -> list[Event]:
        return list(self.pipeline.hub.recent)


async def _run(folder: Path) -> Finished:
    async with SimServer(SIM, port=0) as sim:
        cfg = make_config(folder, sim.base_url, DATASETS,
                          tables={"tokenizer": {"path": str(bundled_kimi_path())},
                                  "engine": {"reconstruct": True, "workers": 1, "max_attempts": 8}})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            state = await asyncio.wait_for(pipeline.generate(), 120)
        finally:
            await pipeline.close()
    return Finished(pipeline, state)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Finished]:
    yield asyncio.run(_run(tmp_path_factory.mktemp("seam")))


def app_on(run: Finished) -> DraftgenApp:
    return DraftgenApp(run.pipeline, title="draftgen", refresh_s=0.05)


# -- the run itself, through its snapshot --------------------------------------------------------


def test_the_run_ends_done_with_every_prompt_answered(finished: Finished) -> None:
    s = finished.snapshot
    assert finished.state == snap.RunState.DONE and s.state == snap.RunState.DONE
    assert [(d.name, d.done, d.total) for d in s.datasets] == [("alpha", 24, 24), ("beta", 16, 16)]
    assert s.retries > 0 and s.errors, "the fault scenario made provider errors"


def test_errors_carry_their_provider(finished: Finished) -> None:
    s = finished.snapshot
    assert s.recent_errors
    assert {r.provider for r in s.recent_errors} <= PROVIDERS, "every 502 names its provider"
    stats = {p.name: p.errors for p in s.provider_stats}
    assert sum(stats.values()) == sum(n for _, n in s.errors), "each error is counted against a provider"


@pytest.mark.parametrize(("fault", "stream"), [("500", False), ("502", True), ("error200", False),
                                             ("error200", True), ("finish_error", True), ("503", False)])
async def test_each_provider_fault_names_its_provider(tmp_path: Path, fault: str, stream: bool) -> None:
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40, faults={fault: 0.4},
                                   retry_after_s=0.01), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4}],
                          tables={"api": {"stream": stream}, "engine": {"reconstruct": False, "max_attempts": 8}})
        pipeline = Pipeline(cfg, TEST_KEY, serve_attach=False, skip_smoke=True)
        await pipeline.start()
        try:
            await asyncio.wait_for(pipeline.generate(), 60)
        finally:
            await pipeline.close()
    s = pipeline.snapshot()
    assert s.recent_errors
    providers = {r.provider for r in s.recent_errors}
    if fault == "503":  # all providers down or full: OpenRouter's own error names none (docs/openrouter.md)
        assert providers == {""} and not any(p.errors for p in s.provider_stats)
    else:
        assert providers <= PROVIDERS, providers
        assert sum(p.errors for p in s.provider_stats) == sum(n for _, n in s.errors) > 0


# -- every panel of the run screen ----------------------------------------------------------------


async def test_header_panel(finished: Finished) -> None:
    s = finished.snapshot
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        header = text(pilot.app, "#header")
        assert "DONE" in header and s.run_name in header and s.model in header
        assert f"elapsed {fmt.clock(s.elapsed_s)}" in header
        assert "run DONE: 40 of 40 answered" in text(pilot.app, "#alert")


async def test_datasets_panel(finished: Finished) -> None:
    s = finished.snapshot
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(pilot.app, "#datasets")
        for d in s.datasets:
            row = next(line for line in shown.splitlines() if line.startswith(f"{d.name} "))
            assert f"{d.done}/{d.total}" in row and fmt.usd(d.cost_usd) in row and d.status in row


async def test_throughput_panel(finished: Finished) -> None:
    t = finished.snapshot.throughput
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(pilot.app, "#throughput")
        assert "since start" in shown and f"in flight {t.in_flight}" in shown
        assert t.avg_completion_tokens_total > 0 and fmt.count(t.avg_completion_tokens_total) in shown


async def test_credits_panel(finished: Finished) -> None:
    c = finished.snapshot.credits
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(pilot.app, "#credits")
        assert c.balance_usd is not None and fmt.usd(c.balance_usd) in shown
        assert c.spent_usd > 0 and re.search(rf"{re.escape(fmt.usd(c.spent_usd))} (this )?run", shown), shown


async def test_errors_panel_and_its_drill_down(finished: Finished) -> None:
    s = finished.snapshot
    kind, n = s.errors[0]
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(pilot.app, "#errors")
        assert re.search(rf"retries\s+{fmt.count(s.retries)}", shown), shown
        assert re.search(rf"{re.escape(kind)}\s+{fmt.count(n)}", shown), shown
        await pilot.press("tab", "enter")  # datasets -> errors; the first kind
        assert isinstance(pilot.app.screen, DrillScreen)
        body = text(pilot.app, "#drill-body")
        assert f"error kind {kind}" in body and "recent errors" in body
        assert any(p in body for p in PROVIDERS), "the kind's recent errors name their providers"


async def test_providers_panel_and_errors_by_provider(finished: Finished) -> None:
    s = finished.snapshot
    first = s.providers[0][0]
    stat = next(p for p in s.provider_stats if p.name == first)
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = text(pilot.app, "#providers")
        for name, _ in s.providers:
            assert name in shown
        await pilot.press("tab", "tab", "enter")  # datasets -> errors -> providers; the first one
        assert isinstance(pilot.app.screen, DrillScreen)
        body = text(pilot.app, "#drill-body")
        assert f"provider {first}" in body
        assert stat.errors > 0 and re.search(rf"errors\s+{fmt.count(stat.errors)} attributed", body), body
        mine = [r for r in s.recent_errors if r.provider == first]
        assert mine and all(r.prompt_id in body for r in mine[-3:]), "its recent errors, with prompt ids"
        assert "no errors recorded" not in body


async def test_history_panel(finished: Finished) -> None:
    async with app_on(finished).run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        panel = pilot.app.query_one("#mini-history")
        assert panel.display and panel.last is finished.snapshot  # type: ignore[attr-defined]
        shown = text(pilot.app, "#mini-history")
        assert "requests/s" in shown and "tokens/s" in shown


async def test_stages_panel_shows_the_tokens_stage(finished: Finished) -> None:
    tokens = finished.snapshot.stage("tokens")
    assert tokens is not None and tokens.state == snap.StageState.DONE and tokens.done == tokens.total == 40
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert not pilot.app.query_one("#stages").has_class("-hidden")
        row = next(line for line in text(pilot.app, "#stages").splitlines() if line.startswith("tokens"))
        assert "done" in row and "40/40" in row


async def test_gpu_panel_follows_the_snapshot(finished: Finished) -> None:
    s = finished.snapshot
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        gpu = pilot.app.query_one("#gpu")
        if s.gpus is None:  # no NVML here and no extraction: nothing to show, the panel is hidden
            assert gpu.has_class("-hidden")
        else:
            assert not gpu.has_class("-hidden") and s.gpus[0].name.removeprefix("NVIDIA ") in text(pilot.app, "#gpu")


async def test_event_log_panel_filters_by_the_events_dataset(finished: Finished) -> None:
    events = finished.events
    async with app_on(finished).run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        log = pilot.app.query_one("#events")
        assert len(log.lines) == len(events)  # type: ignore[attr-defined]
        await pilot.press("l", "d")  # the log view; then its first dataset
        log = pilot.app.screen.events_log  # type: ignore[attr-defined]
        assert log.dataset == "alpha"
        mine = [e for e in events if e.dataset == "alpha"]
        assert {e.kind for e in mine} >= {EventKind.DATASET_START, EventKind.DATASET_DONE}
        assert [line.split(" ", 2)[2].strip() for line in log.lines] == [e.message for e in mine]


# -- typed events -------------------------------------------------------------------------------


def test_the_pipelines_events_are_typed_and_name_their_dataset(finished: Finished) -> None:
    events = finished.events
    assert all(isinstance(e.level, Level) and isinstance(e.kind, EventKind) for e in events)
    per_dataset = [e for e in events if e.kind in (EventKind.DATASET_START, EventKind.DATASET_DONE)]
    assert sorted((e.kind, e.dataset) for e in per_dataset) == [
        ("dataset_done", "alpha"), ("dataset_done", "beta"), ("dataset_start", "alpha"), ("dataset_start", "beta")]
    assert all(e.dataset == "" for e in events if e.kind == EventKind.RUN_DONE)


def test_events_travel_as_json_and_older_ones_still_read() -> None:
    e = Event.of(Budget(reason="token budget reached", dataset="alpha"), ts=1.0)
    said = "alpha: token budget reached; the rest is skipped (stays eligible for a later run)"
    data = orjson.loads(e.to_json())
    assert data == {"ts": 1.0, "level": "warn", "kind": "budget", "message": said,
                    "dataset": "alpha", "data": {"dataset": "alpha", "at": None, "reason": "token budget reached",
                                                 "prompt_id": "", "conversation": "", "turn": 0, "turns": 0,
                                                 "later": 0}}  # `data`: the payload's figures
    assert snap.event_from_dict(data) == e
    # An engine from before the field, and a newer engine's kind: read, not refused.
    older = snap.event_from_dict({"ts": 2.0, "level": "info", "kind": "a_kind_from_later", "message": "m"})
    assert older.dataset == "" and older.level is Level.INFO and older.kind is EventKind.OTHER
    assert isinstance(older.payload, Other) and older.payload.name == "a_kind_from_later" and older.message == "m"
    # The plain strings still compare equal (callers and views written before the enums keep working).
    assert e.level == "warn" and e.kind == "budget" and f"{e.level:<5}" == "warn "


async def test_log_filters_on_the_dataset_field_not_the_message_text() -> None:
    ev = (Event.of(CreditsRead(cause="B1: looks like a dataset, is not one", at=Level.INFO), ts=fx.T0),
          Event.of(Budget(reason="token budget reached", dataset="B1"), ts=fx.T0 + 1))
    app = DraftgenApp(fx.FakeControls(fx.running(), ev), title="draftgen", refresh_s=0.05)  # type: ignore[arg-type]
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("l", "d")
        log = app.screen.events_log  # type: ignore[attr-defined]
        assert log.dataset == "B1" and [line.split(" ", 2)[2].strip() for line in log.lines] == [
            "B1: token budget reached; the rest is skipped (stays eligible for a later run)"]


# -- the hub's drop policy ----------------------------------------------------------------------


def _drain(sub: object) -> list[tuple[str, object]]:
    out = []
    while (item := sub.get_nowait()) is not None:  # type: ignore[attr-defined]
        out.append(item)
    return out


def test_a_slow_subscriber_loses_old_snapshots_and_keeps_every_event() -> None:
    hub = Hub()
    slow, fast = hub.subscribe(maxsize=4), hub.subscribe(maxsize=1000)
    snaps = [dataclasses.replace(fx.running(), seq=i) for i in range(10)]
    events = [Event.of(CreditsRead(cause=f"e{i}", at=Level.INFO), ts=fx.T0 + i) for i in range(2)]
    for i, s in enumerate(snaps):
        hub.publish_snapshot(s)  # never blocks: a publisher is never slowed by a subscriber
        if i in (3, 6):
            hub.publish_event(events[(i - 3) // 3])
    kept = _drain(slow)
    assert [x[1].message for x in kept if x[0] == "event"] == [
        "could not read the balance: e0", "could not read the balance: e1"], "events are kept, in order"
    assert [x[1].seq for x in kept if x[0] == "snapshot"] == [8, 9], "the newest snapshots are kept"
    assert slow.dropped == 12 - 4
    assert len(_drain(fast)) == 12 and fast.dropped == 0, "a slow subscriber costs the others nothing"
    # A newcomer gets the recent events, then the latest snapshot.
    assert [x[0] for x in _drain(hub.subscribe())] == ["event", "event", "snapshot"]


def test_a_subscriber_full_of_events_loses_the_oldest() -> None:
    hub = Hub()
    sub = hub.subscribe(maxsize=3)
    for i in range(5):
        hub.publish_event(Event.of(CreditsRead(cause=f"e{i}"), ts=fx.T0 + i))
    assert [x[1].message for x in _drain(sub)] == [f"could not read the balance: e{i}" for i in (2, 3, 4)]
    assert sub.dropped == 2


# -- exit codes -----------------------------------------------------------------------------------


def test_exit_codes_are_one_enum_matching_the_documented_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "run-end.md").read_text()
    table = readme.split("| exit code | meaning |", 1)[1].split("\n\n", 1)[0]
    assert sorted(int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)) == sorted(ExitCode)
    assert sorted(int(m) for m in re.findall(r"^  (\d+)  ", EXIT_CODES, re.M)) == sorted(ExitCode)
    assert DraftgenError("bad config").exit_code is ExitCode.ERROR
    assert KeyRefusedError("401").exit_code is ExitCode.KEY_REFUSED == 4


def test_the_command_line_exits_with_the_errors_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from draftgen.cli.main import main
    umask = os.umask(0o022)  # main() sets the process's umask: put it back for the tests after this one
    try:
        assert main(["run", str(tmp_path / "missing.toml")]) == ExitCode.ERROR
    finally:
        os.umask(umask)
    assert "missing.toml" in capsys.readouterr().err
