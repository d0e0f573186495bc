"""Deterministic runs for tests and screenshots: snapshots shaped like the reference run, and a fake
control surface that records what the keys asked for.

The reference run: eight datasets B1..B8 (~10,000 prompts each, 83,012 in all), Kimi-K2.5 on
OpenRouter, a 10M-token budget per dataset that long reasoning answers (~5,300 tokens) exhaust after
~1,900 answers, ~3.5 requests/s, ~$15 a dataset.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from draftgen.core.live import snapshot as snap
from draftgen.core.live.events import Event, EventKind
from draftgen.core.live.hub import Hub
from draftgen.core.live.payloads import PAYLOADS
from draftgen.core.live.snapshot import (
    Credits,
    DatasetSnapshot,
    ErrorRecord,
    GpuStat,
    ProviderFidelity,
    ProviderStat,
    RunSnapshot,
    StageProgress,
    Throughput,
    Timeline,
)
from draftgen.core.run.life import standing

if TYPE_CHECKING:
    from textual.pilot import Pilot

    from draftgen.tui.app import DraftgenApp

T0 = 1_767_261_600.0  # 2026-01-01 10:00:00 UTC: every timestamp here counts from it
MODEL = "moonshotai/kimi-k2.5"
RUN = "kimi-k25-eagle3"
BUDGET = 10_000_000
PER_ANSWER = 0.0079  # USD


def _budget_done(name: str, total: int, done: int, cost: float) -> DatasetSnapshot:
    return DatasetSnapshot(name=name, status=snap.DatasetStatus.BUDGET, total=total, done=done, skipped=total - done,
                           concurrency=2000, effective_concurrency=2000, tokens_used=BUDGET - 1_730 * (done % 7),
                           token_budget=BUDGET, cost_usd=cost, projected_cost_usd=cost, truncated=done // 300)


def _datasets(running_status: str = snap.DatasetStatus.RUNNING, b5_done: int = 740) -> tuple[DatasetSnapshot, ...]:
    b5_tokens = b5_done * 5_312
    return (
        _budget_done("B1", 10_002, 1_891, 15.12),
        _budget_done("B2", 10_000, 1_880, 14.87),
        _budget_done("B3", 10_450, 1_902, 15.30),
        _budget_done("B4", 10_120, 1_875, 14.71),
        DatasetSnapshot(name="B5", status=running_status, total=10_310, done=b5_done, failed=2, in_flight=460,
                        concurrency=500, effective_concurrency=460, tokens_used=b5_tokens,
                        tokens_in_flight=460 * 5_312, token_budget=BUDGET, cost_usd=round(b5_done * PER_ANSWER, 2),
                        projected_cost_usd=15.05, truncated=3),
        DatasetSnapshot(name="B6", total=10_800, concurrency=2000, token_budget=BUDGET),
        DatasetSnapshot(name="B7", total=10_640, concurrency=2000, token_budget=BUDGET),
        DatasetSnapshot(name="B8", total=10_690, concurrency=500, token_budget=BUDGET, rejected=3),
    )


def _history(n: int = 180, level: float = 3.5) -> tuple[float, ...]:
    # A steady rate with a slow wave and a dip where a dataset handed over to the next.
    out = []
    for i in range(n):
        v = level + 0.45 * math.sin(i / 6.0) + 0.2 * math.sin(i * 1.7)
        if 60 <= i < 66:
            v *= (i - 59) / 7
        out.append(round(max(0.0, v), 2))
    return tuple(out)


def timeline(seconds: float = 2_368.0, interval: float = 10.0) -> Timeline:
    """The run's history: 2,000 in flight through B1..B4, a hand-over dip, B5 at 500 with a 429 burst."""
    points = []
    for i in range(int(seconds // interval)):
        t = i * interval
        wave = 0.45 * math.sin(i / 9.0) + 0.2 * math.sin(i * 1.3)
        req = max(0.0, 3.5 + wave)
        handover = any(abs(t - h) < 25 for h in (566, 1_102, 1_650, 2_150))
        if handover:
            req *= 0.35
        storm = 2_280 <= t < 2_330
        flight = 500 if t >= 2_150 else 2_000
        if storm:
            flight = 460
        if t < 60:
            req *= t / 60
        points.append((T0 + t, round(req, 3), round(req * 5_290, 1), round(req * 60 * PER_ANSWER, 5),
                       round(6.5 if storm else 0.3 + 0.25 * math.sin(i / 4.0) ** 2, 3),
                       float(flight // 3 if handover else flight)))
    return Timeline(interval_s=interval, points=tuple(points), runs=(T0,))


RECENT_ERRORS = (
    ErrorRecord(ts=T0 + 1_420.2, kind="timeout", dataset="B3", prompt_id="b3-04417", attempt=1,
                message="no answer within request_timeout_s=1800 (total)", provider=""),
    ErrorRecord(ts=T0 + 2_231.0, kind="502 bad gateway", dataset="B5", prompt_id="b5-00212", attempt=1, status=502,
                message="502: Bad Gateway (upstream provider parasail did not answer)", provider="parasail/int4"),
    ErrorRecord(ts=T0 + 2_288.4, kind="429 rate limited", dataset="B5", prompt_id="b5-00871", attempt=1, status=429,
                message="429: Rate limit exceeded: free-models-per-min. Retry-After 4", provider="novita/int4"),
    ErrorRecord(ts=T0 + 2_289.9, kind="429 rate limited", dataset="B5", prompt_id="b5-00893", attempt=2, status=429,
                message="429: Provider novita is temporarily rate-limited upstream; please retry shortly",
                provider="novita/int4"),
    ErrorRecord(ts=T0 + 2_301.7, kind="timeout", dataset="B5", prompt_id="b5-00904", attempt=8, final=True,
                message="no answer within request_timeout_s=1800 (total) after 8 attempts: failed for good",
                provider=""),
    ErrorRecord(ts=T0 + 2_344.1, kind="502 bad gateway", dataset="B5", prompt_id="b5-00951", attempt=8, status=502,
                final=True, message="502: Bad Gateway after 8 attempts: failed for good", provider="together/int4"),
)

PROVIDER_STATS = (
    ProviderStat(name="novita/int4", answers=3_512, errors=31, latency_mean_s=96.4, latency_p90_s=171.0,
                 completion_tokens=3_512 * 5_310),
    ProviderStat(name="parasail/int4", answers=2_790, errors=5, latency_mean_s=88.1, latency_p90_s=158.5,
                 completion_tokens=2_790 * 5_260),
    ProviderStat(name="together/int4", answers=1_986, errors=4, latency_mean_s=104.9, latency_p90_s=190.2,
                 completion_tokens=1_986 * 5_330),
)

FIDELITY = (ProviderFidelity("novita/int4", 3_490, 0.962, 1.0), ProviderFidelity("parasail/int4", 2_771, 0.958, 1.0),
            ProviderFidelity("together/int4", 1_975, 0.955, 0.998))


def decided(s: RunSnapshot) -> RunSnapshot:
    """`s` with what its run's owner sets as the snapshot is made (core/run/life.py `standing`): its label
    and whether it is finished, from its states; every snapshot below is handed out so."""
    st = standing(s.state, s.stage_state("generation"), s.stages)
    return dataclasses.replace(s, label=st.label, finished=st.finished)


def _decided(make: Callable[..., RunSnapshot]) -> Callable[..., RunSnapshot]:
    return functools.wraps(make)(lambda *args, **kwargs: decided(make(*args, **kwargs)))


@_decided
def running(**changes: object) -> RunSnapshot:
    s = RunSnapshot(
        run_name=RUN, model=MODEL, state=snap.RunState.RUNNING, elapsed_s=2_368.0, seq=100, taken_at=T0 + 2_368,
        datasets=_datasets(),
        throughput=Throughput(window_s=30.0, req_s_window=3.62, req_s_total=3.50, tok_s_window=19_230.0,
                              tok_s_total=18_370.0, avg_completion_tokens_window=5_312.0,
                              avg_completion_tokens_total=5_248.0, history=_history(), in_flight=460,
                              effective_concurrency=460, configured_concurrency=500, eta_s=1_890.0),
        errors=(("429 rate limited", 37), ("timeout", 4), ("502 bad gateway", 2)),
        retries=43,
        providers=(("novita/int4", 3_512), ("parasail/int4", 2_790), ("together/int4", 1_986)),
        credits=Credits(balance_usd=64.15, balance_age_s=42.0, spent_usd=65.85, spent_total_usd=65.85,
                        in_flight_usd=3.63, projected_total_usd=120.05, max_usd=130.0, floor_usd=5.0,
                        balance_source="credits", projected_low_usd=104.2, projected_high_usd=130.0),
        stages=(StageProgress(name="smoke", state="idle"), StageProgress(name="merge"),
                StageProgress(name="extract")),
        started_at=T0, first_started_at=T0, timeline=timeline(), recent_errors=RECENT_ERRORS,
        provider_stats=PROVIDER_STATS, fidelity=FIDELITY,
    )
    return dataclasses.replace(s, **changes)  # type: ignore[arg-type]


@_decided
def paused() -> RunSnapshot:
    s = running()
    return dataclasses.replace(s, state=snap.RunState.PAUSED, seq=s.seq + 1,
                               datasets=_datasets(snap.DatasetStatus.PAUSED),
                               throughput=dataclasses.replace(s.throughput, eta_s=None))


@_decided
def backed_off() -> RunSnapshot:
    """The issue-54 run: 2,000 configured, a 429 storm cut the limit to 1,780 (the widest figures)."""
    s = running()
    return dataclasses.replace(s, throughput=dataclasses.replace(s.throughput, in_flight=1_780,
                                                                 effective_concurrency=1_780,
                                                                 configured_concurrency=2_000))


SMOKE_CHECKS = (
    ("API key", True, "valid"),
    ("credits", True, "$64.15 available, above the $5.00 floor"),
    ("requests", True, "B1..B8 answered with each dataset's exact parameters"),
    ("content", True, "non-empty, finish_reason stop"),
    ("reasoning", True, "in `reasoning` (`reasoning_content` is empty)"),
    ("tool calls", True, "none asked, none returned"),
    ("model", True, "moonshotai/kimi-k2.5"),
    ("provider", True, "novita, int4 (fireworks, baseten ignored)"),
    ("usage", True, "205 completion tokens, cost reported"),
    ("tokens", True, "205 reconstructed = 205 billed; one </think>; ends <|im_end|>"),
)


@_decided
def smoke(state: str = "done", checks: int = len(SMOKE_CHECKS)) -> RunSnapshot:
    stage = StageProgress(
        name="smoke", state=state, done=checks, total=len(SMOKE_CHECKS), checks=SMOKE_CHECKS[:checks],
        detail=(("cost per request", "$0.00047 (205 completion tokens)"),
                ("projected run cost", "$118.40 for 83,012 prompts at the budgets"))
        if state == "done" else (),
        message="All checks passed: the run resumes." if state == "done" else "")
    s = running()
    return dataclasses.replace(s, state=snap.RunState.PAUSED, seq=s.seq + 2,
                               datasets=_datasets(snap.DatasetStatus.PAUSED),
                               stages=(stage, StageProgress(name="merge"), StageProgress(name="extract")))


@_decided
def merging() -> RunSnapshot:
    datasets = tuple(_budget_done(d.name, d.total, 1_890 + i * 3, 15.0 + i / 10) for i, d in enumerate(_datasets()))
    s = running()
    merge = StageProgress(name="merge", state="running", done=9_400, total=15_157, rate=4_120.0,
                          rate_unit=" samples/s", eta_s=1.4,
                          detail=(("kept", "9,356"), ("duplicates", "31"), ("truncated", "13"),
                                  ("seed", "1234")))
    return dataclasses.replace(
        s, state=snap.RunState.DONE, elapsed_s=4_980.0, seq=240, datasets=datasets,
        throughput=dataclasses.replace(s.throughput, req_s_window=0.0, tok_s_window=0.0, in_flight=0, eta_s=None,
                                       history=_history()[:-30] + (0.0,) * 30),
        credits=dataclasses.replace(s.credits, balance_usd=9.40, spent_usd=120.60, spent_total_usd=120.60,
                                    in_flight_usd=0.0, projected_total_usd=120.60),
        stages=(StageProgress(name="smoke", state="done", checks=SMOKE_CHECKS),
                StageProgress(name="tokens", state="done", done=15_157, total=15_157),
                merge, StageProgress(name="extract")))


@_decided
def extracting() -> RunSnapshot:
    s = merging()
    merge = StageProgress(name="merge", state="done", done=15_157, total=15_157,
                          detail=(("kept", "15,088"), ("dropped", "69 (duplicates 44, truncated 25)")))
    extract = StageProgress(name="extract", state="running", done=6_000, total=15_088, rate=41_800.0,
                            rate_unit=" tok/s", eta_s=1_150.0,
                            detail=(("backend", "sglang, tp=2"), ("layers", "1, 29, 57"),
                                    ("written", "rows_0-2000 … rows_4000-6000")))
    gpus = (GpuStat(index=0, name="NVIDIA H200", util_pct=97.0, mem_used_mb=128_410.0, mem_total_mb=143_771.0,
                    power_w=612.0, temp_c=64.0),
            GpuStat(index=1, name="NVIDIA H200", util_pct=94.0, mem_used_mb=127_998.0, mem_total_mb=143_771.0,
                    power_w=598.0, temp_c=61.0))
    return dataclasses.replace(s, elapsed_s=5_840.0, seq=300, gpus=gpus,
                               stages=(s.stages[0], s.stages[1], merge, extract))


@_decided
def out_of_credits() -> RunSnapshot:
    s = paused()
    return dataclasses.replace(
        s, alert="402 Payment Required: out of credits. The run is paused; add credits, then press r to resume.",
        credits=dataclasses.replace(s.credits, balance_usd=0.0, balance_age_s=3.0),
        errors=(("402 payment required", 1),) + s.errors)


@_decided
def ended(state: str) -> RunSnapshot:
    """The run after it ended in `state`: DONE has nothing left; the others leave B5..B8 to ask."""
    from draftgen.core.live.summary import ended_line
    s = running()
    if state == snap.RunState.DONE:
        datasets = tuple(_budget_done(d.name, d.total, d.done or 1_900, d.cost_usd or 15.0) for d in s.datasets)
    else:
        datasets = tuple(dataclasses.replace(d, status=snap.DatasetStatus.STOPPED, in_flight=0,
                                             message="stopped before the end; the next run resumes")
                         if d.status in (snap.DatasetStatus.RUNNING, snap.DatasetStatus.PENDING) else d
                         for d in s.datasets)
    alert = ("402 Payment Required: out of credits; add credits and run again" if state == snap.RunState.WAITING
             else "")
    return dataclasses.replace(
        s, state=state, seq=s.seq + 50, datasets=datasets, alert=alert, ended=ended_line(state, datasets),
        throughput=dataclasses.replace(s.throughput, in_flight=0, req_s_window=0.0, tok_s_window=0.0, eta_s=None))


@_decided
def attached() -> RunSnapshot:
    return dataclasses.replace(running(), attached=True)


@_decided
def attached_resumed() -> RunSnapshot:
    """Attached to the third run of a directory, with spend still pending a price."""
    s = attached()
    return dataclasses.replace(s, timeline=dataclasses.replace(s.timeline, runs=(T0 - 7200.0, T0 - 3600.0, T0)),
                               credits=dataclasses.replace(s.credits, pending_usd=0.02))


# -- an agent dataset (docs/agents.md): its snapshot row and its responses.jsonl ----------------------

def agent_dataset(**changes: object) -> DatasetSnapshot:
    """The demo's agent dataset under way: 20 conversations of 3 steps, 5 diverged at step 2 (their step 3
    skipped), 10 done, 3 steps in flight."""
    d = DatasetSnapshot(name="agent", status=snap.DatasetStatus.RUNNING, total=60, done=50, skipped=5, in_flight=3,
                        concurrency=20, effective_concurrency=20, tokens_used=31_840, cost_usd=0.41,
                        projected_cost_usd=0.55, conversations=20, conversations_done=10, conversations_ended=5,
                        turns_by_number=((20, 20), (20, 20), (10, 20)), tool_calls=40, diverged=5,
                        tool_calls_by_number=(20, 20, 0), diverged_by_number=(0, 5, 0))
    return dataclasses.replace(d, **changes)  # type: ignore[arg-type]


@_decided
def with_agent(s: RunSnapshot | None = None, **changes: object) -> RunSnapshot:
    """`s` (the running snapshot) with the agent dataset in place of B6."""
    s = s or running()
    return dataclasses.replace(s, datasets=tuple(agent_dataset(**changes) if d.name == "B6" else d
                                                 for d in s.datasets))


def _reasoning(n: int) -> str:
    return f"Message {n}: what to look at next."


def agent_records(i: int, steps: int, *, answer: str = "", diverge: bool = False) -> list[dict[str, Any]]:
    """The records a run writes for demo agent line `i`'s first `steps` steps, the target calling what the
    line records: each step's `messages` the history sent (the target's own calls, the dataset's results
    under their ids), `tool_results` "matched" after the first step; the last step `diverged` if asked."""
    from draftgen.tui.demo_agent import line

    # The target's own messages go back with their reasoning, as OpenRouter's reasoning_details.
    messages = [dict(m, reasoning_details=[{"type": "reasoning.text", "text": _reasoning(j)}])
                if m["role"] == "assistant" else m for j, m in enumerate(line(i)["messages"])]
    at = [n for n, m in enumerate(messages) if m["role"] == "assistant"]
    records = []
    for k in range(1, steps + 1):
        own = messages[at[k - 1]] if not (answer and k == steps) else {"content": answer}
        record: dict[str, Any] = {
            "id": f"agent-{i}#t{k}", "conversation": f"agent-{i}", "turn": k, "turns": len(at),
            "messages": messages[:at[k - 1]], "reasoning": _reasoning(at[k - 1]),
            "content": own.get("content", ""),
            "tool_calls": own.get("tool_calls"), "finish_reason": "tool_calls" if own.get("tool_calls") else "stop",
            "provider": "novita", "usage": {"prompt_tokens": 400 * k, "completion_tokens": 60}, "ts": T0 + 10 * k,
            "tools": line(i)["tools"]}
        if k > 1:
            record["tool_results"] = "matched"
        if diverge and k == steps:
            record["diverged"] = True
        records.append(record)
    return records


def agent_run_dir(root: Path | None = None) -> Path:
    """A run directory whose agent/responses.jsonl holds three conversations, oldest first: agent-3 diverged
    at step 2 (it answered where the line called run_tests), agent-1 at step 2 of 3, agent-0 answered in
    its 3 steps (the newest)."""
    if root is None:  # a view's (snapshot tests, screenshots): removed when the process ends
        root = Path(tempfile.mkdtemp(prefix="draftgen-agent-"))
        atexit.register(shutil.rmtree, root, True)
    diverged = agent_records(3, 2, diverge=True, answer="merge_config replaces nested tables: merge them recursively.")
    records = [*diverged, *agent_records(1, 2), *agent_records(0, 3)]
    (root / "agent").mkdir(parents=True, exist_ok=True)
    (root / "agent" / "responses.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return root


def events() -> tuple[Event, ...]:
    rows = (
        (0, "info", "run_start", f"run {RUN}: 8 datasets, 83,012 prompts, model {MODEL}"),
        (4, "info", "smoke_done", "smoke test passed: 10/10 checks, $0.00047 per request"),
        (5, "info", "dataset_start", "B1: 10,002 prompts, 0 already answered, concurrency 2,000"),
        (541, "warn", "budget", "B1: token budget 10,000,000 reached; 8,111 prompts skipped, eligible later"),
        (566, "info", "dataset_done", "B1: budget: 1,891/10,002 answered, 0 failed, 8,111 skipped, $15.12"),
        (1_102, "info", "dataset_done", "B2: budget: 1,880/10,000 answered, 0 failed, 8,120 skipped, $14.87"),
        (1_211, "info", "credits", "balance $96.20"),
        (1_650, "info", "dataset_done", "B3: budget: 1,902/10,450 answered, 0 failed, 8,548 skipped, $15.30"),
        (2_150, "info", "dataset_done", "B4: budget: 1,875/10,120 answered, 0 failed, 8,245 skipped, $14.71"),
        (2_151, "info", "dataset_start", "B5: 10,310 prompts, 0 already answered, concurrency 500"),
        (2_290, "warn", "backoff", "B5: sustained 429s, effective concurrency 500 → 460"),
        (2_326, "info", "credits", "balance $64.15"),
    )
    # The dataset an event is about is in its `dataset` field, as the engine sends it (the message names it too).
    return tuple(event(T0 + dt, level, kind, msg, dataset=msg.partition(":")[0] if msg[:1] == "B" and ":" in msg
                       else "") for dt, level, kind, msg in rows)


_ZERO: dict[str, object] = {"int": 0, "float": 0.0, "str": "", "bool": False}


def event(ts: float, level: str, kind: str, message: str, dataset: str = "") -> Event:
    """An event of `kind` as the views get it, its message `message`: its payload gets zero figures
    (the views under test show the message, not the figures), a kind this side does not know comes as
    `Other` (as from a newer engine's stream)."""
    data: dict[str, object] = {"dataset": dataset, "at": level}
    with contextlib.suppress(ValueError):
        cls = PAYLOADS[EventKind(kind)]
        data |= {f.name: _ZERO[str(f.type)] for f in dataclasses.fields(cls) if str(f.type) in _ZERO
                 and f.name not in data and f.default is dataclasses.MISSING}
    return snap.event_from_dict({"ts": ts, "level": level, "kind": kind, "message": message, "dataset": dataset,
                            "data": data})


class FakeControls:
    """The `Controls` protocol over a local Hub: records every call and answers it with the snapshot a
    real engine would publish next, so pilot tests can watch the screen follow."""

    def __init__(self, snapshot: RunSnapshot | None = None, events: Sequence[Event] = (), *,
                 read_only: bool = False, unavailable: Mapping[str, str] | None = None) -> None:
        self.hub = Hub()
        self.read_only = read_only
        self.reasons = dict(unavailable or {})
        self.calls: list[str] = []
        for e in events:
            self.hub.publish_event(e)
        if snapshot is not None:
            self.hub.publish_snapshot(decided(snapshot))

    @property
    def latest(self) -> RunSnapshot:
        assert self.hub.latest is not None
        return self.hub.latest

    def publish(self, s: RunSnapshot) -> None:
        self.hub.publish_snapshot(decided(s))  # as a real engine's: its label and `finished` set

    def event(self, level: str, kind: str, message: str, dataset: str = "") -> None:
        last = self.hub.recent[-1].ts if self.hub.recent else T0
        self.hub.publish_event(event(last + 1, level, kind, message, dataset))

    def _next(self, **changes: object) -> None:
        s = self.latest
        self.publish(dataclasses.replace(s, seq=s.seq + 1, **changes))  # type: ignore[arg-type]

    def unavailable(self, action: str) -> str | None:
        if self.read_only:
            return "attached read-only: this viewer cannot change the run"
        return self.reasons.get(action)

    def pause(self) -> None:
        self.calls.append("pause")
        self._next(state=snap.RunState.PAUSED, datasets=tuple(
            dataclasses.replace(d, status=snap.DatasetStatus.PAUSED) if d.status == snap.DatasetStatus.RUNNING else d
            for d in self.latest.datasets))
        self.event("info", "paused", "paused: no new requests; those in flight finish")

    def resume(self) -> None:
        self.calls.append("resume")
        self._next(state=snap.RunState.RUNNING, alert="", datasets=tuple(
            dataclasses.replace(d, status=snap.DatasetStatus.RUNNING) if d.status == snap.DatasetStatus.PAUSED else d
            for d in self.latest.datasets))
        self.event("info", "resumed", "resumed")

    def run_smoke(self) -> None:
        self.calls.append("smoke")
        self.publish(smoke(state="running", checks=3))

    # What the `m` and `x` keys would ask first (hidden states at stake): None asks nothing.
    merge_asks: str | None = None
    extract_asks: str | None = None

    def merge_question(self) -> str | None:
        return self.merge_asks

    def extract_question(self) -> str | None:
        return self.extract_asks

    def start_merge(self, replace_hidden_states: bool = False) -> None:
        self.calls.append("merge:replace" if replace_hidden_states else "merge")
        self.publish(merging())

    def start_extract(self, on_other_merge: str = "refuse") -> None:
        self.calls.append("extract" if on_other_merge == "refuse" else f"extract:{on_other_merge}")
        self.publish(extracting())

    def start_stage(self, name: str) -> None:
        self.calls.append(f"stage:{name}")

    def quit(self, drain: bool) -> None:
        self.calls.append("quit:drain" if drain else "quit:stop")
        self._next(state=snap.RunState.DRAINING if drain else snap.RunState.STOPPED)

    def spool_held(self) -> None:
        self.calls.append("spool")

    def quit_asked(self, asking: bool) -> None:
        pass


@dataclass(frozen=True)
class View:
    """One screen as the screenshots and snapshot tests show it: a starting snapshot, keys pressed,
    and optionally the snapshot the engine publishes after them (e.g. the smoke result)."""

    name: str
    caption: str
    snapshot: Callable[[], RunSnapshot]
    keys: tuple[str, ...] = ()
    then: Callable[[], RunSnapshot] | None = None
    size: tuple[int, int] = (120, 40)
    read_only: bool = False
    extract_asks: str | None = None  # what `x` asks first (hidden states of another merge)
    run_dir: Callable[[], Path] | None = None  # the run directory the app reads conversations from

    def app(self) -> tuple[DraftgenApp, FakeControls]:
        from draftgen.tui.app import DraftgenApp

        controls = FakeControls(self.snapshot(), events(), read_only=self.read_only)
        controls.extract_asks = self.extract_asks
        return DraftgenApp(controls, title="draftgen", run_dir=self.run_dir() if self.run_dir else None), controls

    async def settle(self, pilot: Pilot[None]) -> None:
        """Press the view's keys, publish what follows them, and let the screen catch up."""
        app = pilot.app
        assert isinstance(app.controls, FakeControls)  # type: ignore[attr-defined]
        await pilot.pause()
        for key in self.keys:
            await pilot.press(key)
        if self.then is not None:
            app.controls.publish(self.then())  # type: ignore[attr-defined]
        app.pull()  # type: ignore[attr-defined]
        await pilot.pause()
        await pilot.pause()


VIEWS = (
    View("running", "A run of eight datasets: four stopped by their token budget, one running", running),
    View("paused", "Paused with p: no new requests, those in flight finish", paused),
    View("smoke", "Smoke test (s): the checklist fills in as the checks complete", running, ("s",), then=smoke),
    View("quit", "Quit (q) asks: drain the requests in flight, or stop now", running, ("q",)),
    View("help", "Help (?)", running, ("question_mark",)),
    View("attach", "draftgen attach RUN_DIR: the same panels, read-only, control keys disabled", attached,
         read_only=True),
    View("alert", "Out of credits (402): the run pauses and says why", out_of_credits),
    View("merge", "Merge (m) in progress after the run", merging),
    View("extract", "Hidden-state extraction (x) with the GPU panel", extracting),
    View("extract_other_merge", "Extraction (x) over hidden states of another merge: start over or set them aside",
         lambda: ended(snap.RunState.DONE), ("x",), extract_asks=(
             "hidden_states/ holds 338 files of merge b63c80272c43b1c5 (338 samples, 183,360 tokens, seed 42), but "
             "merged/ is merge a48fbffc52b86056 (338 samples, 183,360 tokens, seed 7) ([merge] seed 42 -> 7 (the "
             "samples are in another order)). Nothing is added to hidden states of another merge: start over "
             "(delete them) or set them aside (move them to hidden_states.merge-b63c80272c43b1c5/, nothing "
             "deleted), then extract this merge.")),
    View("running_80x24", "The same run in an 80x24 terminal", running, size=(80, 24)),
    View("running_200x50", "A wide terminal (200x50): the history beside the tables, more events", running,
         size=(200, 50)),
    View("drill_dataset", "Drill-down (enter on a dataset): its figures and recent errors with prompt ids",
         running, ("j", "j", "j", "j", "enter")),
    View("drill_kind", "Drill-down on an error kind (tab to the errors panel, enter)", running, ("tab", "enter")),
    View("drill_provider", "Drill-down on a provider: share, errors, latency", running, ("tab", "tab", "enter")),
    View("history", "History (h): the whole run's rates as charts", running, ("h",)),
    View("log_filter", "The events log (l), warnings and errors only (v)", running, ("l", "v")),
    View("log_search", "The events log searched with /", running, ("slash", *"balance", "enter")),
    View("drained", "A drained run ends DRAINED, with what is left to ask", lambda: ended(snap.RunState.DRAINED)),
    View("done", "A finished run: DONE only when every prompt has an outcome", lambda: ended(snap.RunState.DONE)),
    View("too_small", "Below 80x24: one line says so", running, size=(70, 20)),
    View("extract_80x24", "Extraction in an 80x24 terminal", extracting, size=(80, 24)),
    View("attach_80x24", "Attached to a resumed run at 80x24: the run name stays", attached_resumed,
         size=(80, 24), read_only=True),
    View("attach_pending", "Attached at 120x40 with spend pending a price: nothing clipped", attached_resumed,
         read_only=True),
    View("agent", "An agent dataset (tools, turns = \"all\"): steps, tool calls and diverged under the table",
         with_agent),
    View("drill_agent", "Drill-down on an agent dataset: a conversation step by step, tool calls and results",
         with_agent, ("j", "j", "j", "j", "j", "enter"), size=(120, 50), run_dir=agent_run_dir),
    View("backed_off", "A 429 storm cut the limit: effective of configured, whole", backed_off),
    View("backed_off_80x24", "The limit cut by a storm at 80x24: the configured value still whole", backed_off,
         size=(80, 24)),
)
