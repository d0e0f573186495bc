"""The run's state, gate and how generation ended (core/generate/loop/run_state.py) and a dataset's counts
(core/generate/loop/dataset_run.py): each change a method, its effect, and the invariant answered + failed
+ skipped + left = total."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from draftgen.core.generate.api.account import AccountStop
from draftgen.core.generate.api.classify import AccountCondition
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.generate.loop.dataset_run import DatasetRun
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.loop.run_state import Hold, PausedBy, RunControl
from draftgen.core.generate.money.budget import TokenBudget
from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import EventKind
from draftgen.core.live.snapshot import DatasetStatus, RunState
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config


def control() -> tuple[RunControl, list[tuple[str, str, str]]]:
    events: list[tuple[str, str, str]] = []
    return RunControl(lambda p: events.append((p.level, p.kind, p.text()))), events


def kinds(events: list[tuple[str, str, str]]) -> list[str]:
    return [kind for _, kind, _ in events]


async def test_start_pause_resume_and_who_paused() -> None:
    run, events = control()
    assert run.state == RunState.IDLE and not run.pause(PausedBy.USER), "nothing to pause before the start"
    run.start()
    assert run.state == RunState.RUNNING and run.is_open
    assert run.pause(PausedBy.SMOKE)
    view = run.view()
    assert view.state == RunState.PAUSED and view.paused_by is PausedBy.SMOKE and view.hold is None
    assert not run.is_open and run.paused
    assert not run.pause(PausedBy.USER), "a second pause changes nothing"
    assert run.view().paused_by is PausedBy.SMOKE
    run.resume()
    view = run.view()
    assert view.state == RunState.RUNNING and view.paused_by is None and view.alert == "" and run.is_open
    assert kinds(events) == [EventKind.PAUSED, EventKind.RESUMED]
    assert "smoke test" in events[0][2]


async def test_hold_keeps_its_reason_until_resumed_and_says_it_once() -> None:
    run, events = control()
    run.start()
    stop = AccountStop(AccountCondition.OUT_OF_CREDITS, "402 out of credits")
    run.hold(Hold.ACCOUNT, "402: add credits", account=stop)
    run.hold(Hold.ACCOUNT, "402: add credits")  # an answer in flight when it began: said once
    view = run.view()
    assert view.state == RunState.PAUSED and view.hold is Hold.ACCOUNT and view.alert == "402: add credits"
    assert view.account is stop and not run.is_open
    assert kinds(events) == [EventKind.ALERT]
    run.hold(Hold.DISK, "disk full")  # a new reason is said, and replaces the last
    assert run.view().hold is Hold.DISK and run.alert == "disk full" and kinds(events).count(EventKind.ALERT) == 2
    run.resume()
    view = run.view()
    assert view.hold is None and view.account is None and view.alert == "" and run.is_open


async def test_a_hold_while_paused_by_the_user_records_the_reason_and_stays_paused() -> None:
    run, _ = control()
    run.start()
    run.pause(PausedBy.USER)
    run.hold(Hold.DISK, "disk full")
    assert run.state == RunState.PAUSED and run.current_hold is Hold.DISK and run.alert == "disk full"


async def test_drain_then_stop_close_the_gate_and_wake_what_waits() -> None:
    run, _ = control()
    run.start()
    run.pause(PausedBy.USER)
    waiter = asyncio.ensure_future(run.wait_open())
    await asyncio.sleep(0)
    assert not waiter.done()
    assert run.drain() and not run.drain(), "the second drain changes nothing"
    await asyncio.wait_for(waiter, 1)  # what waited for a resume sees the drain
    assert run.state == RunState.DRAINING and run.draining and run.closed and not run.stopping
    assert run.stop() and not run.stop()
    assert run.stopping and run.draining
    assert run.end([Left(1)]) == RunState.STOPPED, "stop now with prompts left"
    assert run.state == RunState.STOPPED and not run.drain(), "a finished run does not drain"


async def test_stop_before_the_start_and_fail_and_end() -> None:
    run, _ = control()
    assert run.stop() and run.closed
    run.start()
    assert run.state == RunState.RUNNING, "a stop is the gate's; the state is set when the run ends"
    run.fail("the prompt file is missing")
    assert run.state == RunState.STOPPED and run.alert == "the prompt file is missing"


class Left:
    """A dataset's counts with `left` prompts not asked yet (summary.py Counted)."""
    def __init__(self, left: int, skipped: int = 0) -> None:
        self.total, self.done, self.failed, self.skipped = 5 + left + skipped, 5, 0, skipped


async def test_how_generation_ended_is_decided_once_by_run_control_from_what_it_left() -> None:
    """RunControl.end, the one rule: DONE only when no prompt is left (LIMITED when max_usd skipped some);
    with prompts left, WAITING while the account held admission, STOPPED after stop now, DRAINED after a
    drain, STOPPED when a dataset stopped by its routing; the line says it with the counts."""
    def ended(left: int, *steps: str, money_limited: bool = False) -> tuple[RunState, str]:
        run, _ = control()
        run.start()
        for step in steps:
            if step == "hold":
                run.hold(Hold.ACCOUNT, "402: add credits", account=AccountStop(AccountCondition.OUT_OF_CREDITS, "402"))
            else:
                getattr(run, step)()
        final = run.end([Left(left)], money_limited=money_limited)
        assert run.state == final
        return final, run.ended

    assert ended(0, "stop") == (RunState.DONE, "DONE: 5 of 5 answered, 0 failed, 0 skipped, 0 not asked yet")
    assert ended(0, money_limited=True)[0] == RunState.LIMITED
    assert ended(2, "drain")[1] == "DRAINED: 5 of 7 answered, 0 failed, 0 skipped, 2 not asked yet"
    assert ended(2, "drain", "stop")[0] == RunState.STOPPED
    assert ended(2, "hold", "drain")[0] == RunState.WAITING
    assert ended(2)[0] == RunState.STOPPED, "a dataset stopped by its routing left prompts"
    quit_early, _ = control()
    quit_early.not_started()
    assert (quit_early.state, quit_early.ended) == (RunState.STOPPED, "")


def dataset(tmp_path) -> DatasetRun:
    cfg = make_config(tmp_path, "http://127.0.0.1:9", [{"name": "a", "n": 5}]).datasets[0]
    return DatasetRun(cfg, TokenBudget(cfg.token_budget, cfg.max_tokens), AdaptiveConcurrency(cfg.concurrency))


def test_dataset_counts_change_through_methods_and_keep_the_invariant(tmp_path) -> None:
    ds = dataset(tmp_path)
    ds.answered("a-0", 10, 0.5, short=True, now=False)  # read back from disk before the file is counted
    ds.failed_one("a-1", now=False)
    ds.counted(total=5, rejected=1, fresh=3)
    assert (ds.total, ds.done, ds.failed, ds.skipped, ds.left, ds.rejected) == (5, 1, 1, 0, 3, 1)
    ds.answered("a-2", 20, 0.25, short=False)
    assert (ds.done, ds.left, ds.answered_now, ds.truncated, ds.cost, ds.token_budget.used) == (2, 2, 1, 1, 0.75, 30)
    ds.failed_one("a-3")
    ds.skipped_some()
    assert (ds.failed, ds.skipped, ds.left) == (2, 1, 0)
    assert ds.done + ds.failed + ds.skipped + ds.left == ds.total
    assert ds.done_ids == {"a-0", "a-1", "a-2", "a-3"}
    ds.unrecorded("a-2", answer=True)  # a held answer no place took: asked again next run
    assert (ds.done, ds.left) == (1, 1) and "a-2" not in ds.done_ids


def test_the_invariant_fires_on_a_count_past_the_prompts(tmp_path) -> None:
    ds = dataset(tmp_path)
    ds.counted(total=2, rejected=0, fresh=2)
    ds.answered("a-0", 1, 0.0, short=False)
    ds.skipped_some()
    with pytest.raises(AssertionError, match="answered"):
        ds.skipped_some()  # a third outcome for two prompts: counted twice somewhere


async def test_a_real_run_ends_with_nothing_left_and_outcomes_of_an_edited_file_kept(tmp_path) -> None:
    """An answer on disk whose id the prompt file no longer has counts as done, and the run still accounts
    for every prompt of the file."""
    async with SimServer(SimConfig(seed=5, latency_scale=0.0, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 12, "concurrency": 4}])
        rd = RunDir(cfg.run_dir)
        rd.responses("a").parent.mkdir(parents=True, exist_ok=True)
        rd.responses("a").write_bytes(orjson.dumps({"id": "gone-1", "messages": [], "content": "x",
                                                    "usage": {"completion_tokens": 3}}) + b"\n")
        engine = Engine(cfg, TEST_KEY, seed=1)
        assert await engine.run() == snap.RunState.DONE
    row = dataset_row(engine, "a")
    assert (row.total, row.done, row.failed, row.skipped) == (12, 13, 0, 0)
    # `left` (the file's prompts with no outcome yet) is the engine's own count: no snapshot field carries it.
    assert engine.datasets["a"].left == 0


def test_a_datasets_state_changes_only_through_its_methods(tmp_path) -> None:
    """Status, message, requests in flight, parked and sent are read-only: admission, room and
    attempts change them through a method, so one place says what each change means."""
    ds = dataset(tmp_path)
    for name in ("status", "message", "in_flight", "parked", "sent"):
        with pytest.raises(AttributeError):
            setattr(ds, name, getattr(ds, name))
    ds.running()
    ds.request_started()
    ds.request_started()
    ds.park()
    assert (ds.status, ds.in_flight, ds.parked, ds.note_sent(), ds.note_sent()) == (DatasetStatus.RUNNING, 2, 1, 1, 2)
    ds.unpark()
    ds.request_ended()
    ds.end(DatasetStatus.BUDGET, "token_budget reached")
    ds.end(DatasetStatus.BUDGET)  # None keeps the message a stop or a budget gave
    assert (ds.status, ds.message, ds.in_flight, ds.parked, ds.sent) == (DatasetStatus.BUDGET, "token_budget reached",
                                                                         1, 0, 2)


def test_the_held_outcome_changes_only_through_the_run_owner() -> None:
    import dataclasses
    run, _ = control()
    run.held_written()
    run.spool_imported()
    run.held_lost(3)
    out = run.held_outcome
    assert (out.written, out.imported, out.lost) == (1, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.written = 5  # type: ignore[misc]  # a reader cannot change it
    assert run.view().held_outcome is out
