"""Issue 54's long run, as an operator runs it: `draftgen run --headless` watched through `/metrics`.

    python benchmarks/operator_run.py [--n 40000] [--concurrency 2000] [--mean-tokens 300]
                                      [--latency-scale 5] [--pause 20] [--drain-at 0.6] [--dir DIR]

The simulator runs in its own process (`draftgen simulate`, 1% of requests a 429 with Retry-After 1 s,
the realistic latency scaled by --latency-scale); the run is a real `python -m draftgen.cli.main run
CONFIG --headless --skip-smoke` subprocess with `[monitor] metrics` on, reconstruction off. The plan:

- `/metrics` is scraped every 2 s (aiohttp, parsed with prometheus_client's text parser): the adaptive
  limit, in flight, answered, the state and the projection over time, and the run's RSS (psutil);
- at 15% and 30% of the prompts answered: `requests_total{outcome="answered"}` against the lines of
  responses.jsonl read right after the scrape (equal within what is in flight), the second above the first;
- at 35%: SIGUSR2 pauses the run for --pause s; the simulator's request counter 1 s after the signal and at
  its end must be equal (nothing sent during a pause, retries included); SIGUSR1 resumes;
- at --drain-at: the projection, then SIGTERM (a drain); the last scrape before the process exits gives the
  projection after the drain: equal to the one before within 5% (the estimate of what is left moves with the
  answers the drain adds; before issue 54's fix it fell to the spend so far); the run exits 3;
- a second run resumes the directory to the end (exit 0), then `draftgen ledger` settles the money.

At the end: every prompt answered exactly once, none failed, the spend ledger equal to what the simulator
billed (the answers' `usage.cost` beside it: requests timed out are billed with no answer), events.log read
back (its lines, the limit and storm events), the limit's range outside
storms against the configured concurrency. It prints a table of the figures against the issue's targets;
exit 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import psutil
from bench_engine import KEY, free_port, sim_stats, start_sim
from prometheus_client.parser import text_string_to_metric_families
from run_files import write_run

from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
DATASET = "ops"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: Samples, name: str, **labels: str) -> float | None:
    return m.get((f"draftgen_{name}", frozenset(labels.items())))


def state(m: Samples) -> str:
    return next((dict(k[1])["state"] for k, v in m.items() if k[0] == "draftgen_run_state" and v == 1), "?")


def lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclass
class Watch:
    """What the scrapes saw: (seconds since the start, limit, in flight, answered, state, projection, RSS)."""
    t0: float = field(default_factory=time.monotonic)
    series: list[tuple[float, float, float, float, str, float | None, int]] = field(default_factory=list)
    last: Samples = field(default_factory=dict)
    scrapes: int = 0


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url) as r:
        r.raise_for_status()
        return parse(await r.text())


async def poll(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, w: Watch) -> None:
    """Scrape every 2 s while the run serves; the last good scrape stays in `w.last`."""
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            m = await scrape(session, url)
        except (aiohttp.ClientError, OSError):
            await asyncio.sleep(0.5)
            continue
        w.last, w.scrapes = m, w.scrapes + 1
        try:
            rss = ps.memory_info().rss
        except psutil.Error:
            rss = 0
        w.series.append((time.monotonic() - w.t0, value(m, "concurrency_limit") or 0,
                         value(m, "in_flight_requests") or 0, value(m, "requests_total", outcome="answered") or 0,
                         state(m), value(m, "projected_total_dollars"), rss))
        await asyncio.sleep(2.0)


async def until_answered(w: Watch, proc: subprocess.Popen, count: float, n: int, step: str) -> None:
    """Until the scrapes show `count` answered. The benchmark stops, saying why, when the run has ended or
    answered every prompt before the plan's next `step`: its checks would read a run that did not do what
    they check (a run of a few seconds: the scrapes are 2 s apart)."""
    while (not w.series or w.series[-1][3] < count) and proc.poll() is None:
        await asyncio.sleep(0.5)
    answered = w.series[-1][3] if w.series else 0
    if proc.poll() is not None or answered >= n:
        raise SystemExit(f"the run went faster than the plan: {answered:,.0f} of {n:,} answered "
                         f"({'it has ended' if proc.poll() is not None else 'at one scrape'}) before the {step}; "
                         "the scrapes are 2 s apart, so raise --n or --latency-scale")


def start_run(config: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "run", str(config), "--headless",
                             "--skip-smoke"], cwd=config.parent, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "BENCH_KEY": KEY}, start_new_session=True)


async def operate(root: Path, config: Path, args: argparse.Namespace, sim_port: int, mport: int) -> dict:
    url = f"http://127.0.0.1:{mport}/metrics"
    rundir = RunDir(root / "run")
    n = args.n
    fig: dict = {"checks": {}}
    log = root / "run.log"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        w = Watch()
        proc = start_run(config, log)
        poller = asyncio.create_task(poll(session, url, proc, w))
        try:
            # Two scrapes: the counter rises and equals the lines on disk within what was in flight.
            for name, share in (("scrape1", 0.15), ("scrape2", 0.30)):
                await until_answered(w, proc, n * share, n, f"{name}'s count")
                m = await scrape(session, url)
                on_disk = lines(rundir.responses(DATASET))
                counted = value(m, "requests_total", outcome="answered") or 0
                fig[name] = (counted, on_disk, value(m, "in_flight_requests") or 0)
            (c1, d1, f1), (c2, d2, f2) = fig["scrape1"], fig["scrape2"]
            fig["checks"]["counter rises, equals disk within in flight"] = (
                c2 > c1 and abs(c1 - d1) <= f1 and abs(c2 - d2) <= f2)

            # A pause: nothing reaches the simulator, retries included.
            await until_answered(w, proc, n * 0.35, n, "pause")
            before = sim_stats(sim_port)["requests_total"]
            os.kill(proc.pid, signal.SIGUSR2)
            await asyncio.sleep(1.0)
            r0 = sim_stats(sim_port)["requests_total"]
            await asyncio.sleep(args.pause - 1.0)
            paused_state = state(await scrape(session, url))
            r1 = sim_stats(sim_port)["requests_total"]
            os.kill(proc.pid, signal.SIGUSR1)
            fig["pause"] = (r0 - before, r1 - r0, paused_state)
            fig["checks"]["0 requests during the pause"] = r1 == r0 and paused_state == "PAUSED"

            # A drain: the projection after it equals the one before.
            await until_answered(w, proc, n * args.drain_at, n, "drain")
            m = await scrape(session, url)
            p0, done0 = value(m, "projected_total_dollars"), value(m, "requests_total", outcome="answered")
            fig["spent_at_drain"] = value(m, "spend_dollars", scope="ledger")
            os.kill(proc.pid, signal.SIGTERM)
            rc1 = await asyncio.to_thread(proc.wait)
        finally:
            await _end(proc, poller)
        p1, done1 = value(w.last, "projected_total_dollars"), value(w.last, "requests_total", outcome="answered")
        fig["drain"] = (p0, p1, done0, done1, state(w.last), rc1)
        fig["checks"]["projection kept by the drain"] = (
            p0 is not None and p1 is not None and abs(p1 - p0) <= 0.05 * p0 and rc1 == 3)
        fig["rss"] = _rss_per_answer(w, n)

        # The resume, to the end.
        w2 = Watch(t0=w.t0)
        proc = start_run(config, log)
        poller = asyncio.create_task(poll(session, url, proc, w2))
        try:
            rc2 = await asyncio.to_thread(proc.wait)
        finally:
            await _end(proc, poller)
        fig["rc2"] = rc2
        # As an operator settles the money after a run: `draftgen ledger` prices what the runs could not
        # (attempts with no generation id, from the key's usage once they cannot still be running).
        settled = subprocess.run([sys.executable, "-m", "draftgen.cli.main", "ledger", str(config)], cwd=root,
                                 env={**os.environ, "BENCH_KEY": KEY}, capture_output=True, text=True)
        fig["ledger_rc"] = settled.returncode
        fig["series"] = w.series + w2.series
        fig["scrapes"] = w.scrapes + w2.scrapes
    fig["elapsed_s"] = time.monotonic() - w.t0
    return fig


async def _end(proc: subprocess.Popen, poller: asyncio.Task) -> None:
    """The run ended (or the benchmark failed: kill it and its session), and its scrapes with it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    await poller


def _rss_per_answer(w: Watch, n: int) -> float | None:
    """The run process's RSS growth per answer between answers n/4 and the last scrape of the first run."""
    pts = [(a, rss) for _, _, _, a, _, _, rss in w.series if a >= n / 4 and rss]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def audit(root: Path, fig: dict, args: argparse.Namespace, sim_port: int) -> None:
    rundir = RunDir(root / "run")
    ids: list[str] = []
    cost = 0.0
    with open(rundir.responses(DATASET), "rb") as f:
        for line in f:
            rec = orjson.loads(line)
            ids.append(rec["id"])
            cost += (rec.get("usage") or {}).get("cost") or 0.0
    failed = lines(rundir.failures(DATASET)) if rundir.failures(DATASET).exists() else 0
    stats = sim_stats(sim_port)
    fig["answered"], fig["unique"], fig["failed"] = len(ids), len(set(ids)), failed
    fig["cost"], fig["billed"] = cost, stats["billed_usd"]
    fig["sim"] = {k: stats[k] for k in ("requests_total", "by_status", "faults", "answers_total")}
    fig["checks"]["every prompt once, 0 lost, 0 duplicated"] = len(ids) == len(set(ids)) == args.n and failed == 0
    # The ledger, not the answers: a request timed out (a slow replica) is billed by the service, and booked by
    # the ledger at what the key's usage says (money.md), with no answer to carry its cost.
    fig["ledger"] = SpendLedger.read(rundir.spend).spent_usd
    fig["checks"]["the ledger = billed, to the cent"] = round(fig["ledger"], 2) == round(stats["billed_usd"], 2)
    fig["checks"]["resumed run exits 0"] = fig["rc2"] == 0
    events = rundir.events_log.read_text().splitlines()
    fig["events"] = len(events)
    fig["storm_events"] = [e for e in events if "429 storm" in e or "limit back" in e]
    fig["limit_events"] = [e for e in events if "limit" in e]
    running = [(t, lim) for t, lim, _, _, st, _, _ in fig["series"] if st == "RUNNING" and lim]
    fig["limit_range"] = (min(lim for _, lim in running), max(lim for _, lim in running)) if running else (0, 0)
    storms = any("429 storm:" in e for e in events)
    low = fig["limit_range"][0]
    fig["checks"]["limit within 5% of configured outside storms"] = (
        storms or low >= 0.95 * args.concurrency)
    # Each change of the limit is an event with its reason: a cut is seen only with a storm event.
    fig["checks"]["each limit change an event"] = low >= args.concurrency or storms


def report(fig: dict, args: argparse.Namespace, latency: tuple[float, float]) -> None:
    (c1, d1, f1), (c2, d2, f2) = fig["scrape1"], fig["scrape2"]
    lag, sent, paused = fig["pause"]
    p0, p1, done0, done1, st, rc1 = fig["drain"]
    lo, hi = fig["limit_range"]
    rss = fig["rss"]
    print(f"{args.n:,} prompts at {args.concurrency:,} in flight, 1% 429s, latency {latency[0]:.1f} s mean "
          f"(p90 {latency[1]:.1f} s) over {fig['elapsed_s']:.0f} s, {fig['scrapes']} scrapes")
    print("| figure | issue's target | measured |")
    print("|---|---|---|")
    print(f"| answered / unique / failed | {args.n:,} once each, 0 lost | {fig['answered']:,} / {fig['unique']:,} / "
          f"{fig['failed']:,} |")
    print(f"| spend ledger / simulator billed (answers' usage.cost) | equal to the cent | ${fig['ledger']:.4f} / "
          f"${fig['billed']:.4f} (${fig['cost']:.4f}) |")
    print(f"| /metrics answered counter vs responses.jsonl lines | equal within in flight | {c1:,.0f} vs {d1:,} "
          f"({f1:,.0f} in flight); {c2:,.0f} vs {d2:,} ({f2:,.0f}) |")
    print(f"| requests reaching the simulator during a {args.pause:g} s pause | 0 | {sent:,} (state {paused}; "
          f"{lag:,} in the 1 s after the signal) |")
    pr = f"${p0:.2f} → ${p1:.2f} ({(p1 - p0) / p0:+.2%})" if p0 and p1 is not None else f"{p0} → {p1}"
    print(f"| projected total before / after a drain | equal (within 5%: the estimate moves with the answers "
          f"the drain adds) | {pr}; spent ${fig['spent_at_drain'] or 0:.2f} then; answered {done0:,.0f} → "
          f"{done1:,.0f}, {st}, exit {rc1} |")
    print(f"| adaptive limit while RUNNING | within 5% of {args.concurrency:,} outside storms | "
          f"{lo:,.0f} to {hi:,.0f} |")
    print(f"| events.log | each limit change, storm, provider an event | {fig['events']} lines, "
          f"{len(fig['limit_events'])} about the limit, {len(fig['storm_events'])} storm |")
    print(f"| run RSS growth per answer (first run, from n/4) | bounded | "
          f"{'-' if rss is None else f'{rss:.0f} B'} |")
    print(f"\nsimulator: {fig['sim']}")
    for e in fig["limit_events"][:20]:
        print("  event:", e[:200])
    print("\nchecks:")
    for name, ok in fig["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40_000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--mean-tokens", type=int, default=300, help="the simulator's mean answer (default 300)")
    p.add_argument("--latency-scale", type=float, default=5.0,
                   help="the simulator's realistic latency times this (default 5: ~18 s an answer at 300 tokens)")
    p.add_argument("--pause", type=float, default=20.0, help="seconds the run stays paused (default 20)")
    p.add_argument("--drain-at", type=float, default=0.6, help="share answered when SIGTERM drains (default 0.6)")
    p.add_argument("--dir", type=Path, default=None, help="keep the run here (default: a temporary directory)")
    args = p.parse_args()
    sim_port, mport = free_port(), free_port()
    sim = start_sim(sim_port, "--faults", "429=0.01", "--latency-scale", str(args.latency_scale),
                    "--retry-after", "1", mean_tokens=args.mean_tokens)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = args.dir or Path(tmp)
            root.mkdir(parents=True, exist_ok=True)
            config = write_run(root, f"http://127.0.0.1:{sim_port}/api/v1", dataset=DATASET, n=args.n,
                               concurrency=args.concurrency, max_tokens=4096, request_timeout_s=120,
                               tables={"engine": {"reconstruct": False}, "budget": {"max_usd": 10000},
                                       "monitor": {"metrics": f"127.0.0.1:{mport}"}},
                               prompt=lambda i: f"Question {i}: explain step {i % 97}.")
            fig = asyncio.run(operate(root, config, args, sim_port, mport))
            audit(root, fig, args, sim_port)
            lat = _latency(root)
    finally:
        sim.kill()
        sim.wait()
    report(fig, args, lat)
    sys.exit(0 if all(fig["checks"].values()) else 1)


def _latency(root: Path) -> tuple[float, float]:
    """Mean and p90 of the answers' latency as the records say (`latency_s`), seconds."""
    vals: list[float] = []
    with open(RunDir(root / "run").responses(DATASET), "rb") as f:
        for line in f:
            v = orjson.loads(line).get("latency_s")
            if isinstance(v, (int, float)):
                vals.append(float(v))
    if not vals:
        return 0.0, 0.0
    vals.sort()
    return sum(vals) / len(vals), vals[int(0.9 * (len(vals) - 1))]


if __name__ == "__main__":
    main()
