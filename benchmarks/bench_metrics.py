"""What scraping /metrics costs a run at 2,000 in flight ([monitor] metrics, core/live/metrics.py).

    python benchmarks/bench_metrics.py [--n 16000] [--concurrency 2000] [--latency 2.0] [--hz 10] [--rounds 2]

The simulator runs in its own process with a fixed latency, so 2,000 requests really are in flight.
Each row runs the real Pipeline headless (engine, attach socket, snapshots at 4 Hz, reconstruction
off) in a fresh process, alternating over the rounds: `plain` without metrics, `scraped` with
`[monitor] metrics` on and another process scraping /metrics `--hz` times a second (Prometheus
scrapes every 15 s by default: 10 Hz is 150 times that). A probe task sleeps 10 ms at a time and records
how late it wakes (the event-loop lag); in the scraped row the handler's time on the loop is measured
around each scrape (rendering the latest snapshot as Prometheus text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import KEY, free_port, sim_stats, start_sim  # noqa: E402
from bench_ui_lag import LagProbe, write_config  # noqa: E402

SCRAPER = """
import sys, time, urllib.request
url, period = sys.argv[1], 1.0 / float(sys.argv[2])
while True:
    t = time.monotonic()
    urllib.request.urlopen(url, timeout=10).read()
    time.sleep(max(0.0, period - (time.monotonic() - t)))
"""


async def measure(mode: str, config_path: Path, hz: float) -> dict:
    import dataclasses

    from draftgen.core.config_load import load_config
    from draftgen.core.live import metrics
    from draftgen.core.run.pipeline import Pipeline
    config = load_config(config_path)
    if mode == "scraped":
        config = dataclasses.replace(config, monitor=dataclasses.replace(config.monitor, metrics="127.0.0.1:0"))
    costs: list[float] = []
    sizes: list[int] = []
    handler = metrics.MetricsServer._metrics

    async def timed(self: metrics.MetricsServer, request: object) -> object:
        t = time.perf_counter()
        response = await handler(self, request)  # type: ignore[arg-type]
        costs.append(time.perf_counter() - t)
        sizes.append(len(response.body))
        return response

    metrics.MetricsServer._metrics = timed  # type: ignore[method-assign]
    pipeline = Pipeline(config, KEY, skip_smoke=True)
    await pipeline.start()
    scraper = None
    if mode == "scraped":
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, pipeline._metrics.url, str(hz)],
                                   stderr=subprocess.DEVNULL)
    probe = LagProbe(pipeline)
    start = time.perf_counter()
    await pipeline.generate()
    elapsed = time.perf_counter() - start
    lag = probe.stop()
    if scraper is not None:
        scraper.terminate()
        scraper.wait()
    done = pipeline.engine.datasets["lag"].done
    await pipeline.close()
    costs_ms = sorted(x * 1000 for x in costs) or [0.0]
    return {"req_s": done / elapsed, **lag, "scrapes": len(costs), "scrape_p50": statistics.median(costs_ms),
            "scrape_p99": costs_ms[int(len(costs_ms) * 0.99)], "scrape_share": sum(costs) / elapsed,
            "bytes": max(sizes, default=0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--latency", type=float, default=2.0)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child")
    p.add_argument("--config")
    args = p.parse_args()
    if args.child:
        from draftgen.core import runtime  # the loop `draftgen run` runs on
        print(json.dumps(runtime.run(measure(args.child, Path(args.config), args.hz))))
        return
    os.environ["BENCH_KEY"] = KEY
    port = free_port()
    sim = start_sim(port, "--fixed-latency", str(args.latency))
    rows: dict[str, list[dict]] = {"plain": [], "scraped": []}
    try:
        for _ in range(args.rounds):
            for mode in rows:
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = write_config(Path(tmp), f"http://127.0.0.1:{port}/api/v1", args.n, args.concurrency)
                    out = subprocess.run([sys.executable, __file__, "--child", mode, "--config", str(cfg),
                                          "--hz", str(args.hz)], capture_output=True, text=True, check=True)
                    rows[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        sim_peak = sim_stats(port).get("peak_in_flight")
    finally:
        sim.terminate()
        sim.wait()
    print(f"\n/metrics scraped at {args.hz:g} Hz, {args.concurrency} in flight (simulator latency fixed "
          f"{args.latency:g} s), {args.n} requests, {args.rounds} round(s), medians over the rounds\n")
    print(f"| {'row':8} | {'req/s':>6} | {'lag p50 ms':>10} | {'lag p99 ms':>10} | {'peak in flight':>14} "
          f"| {'scrapes':>7} | {'scrape p50 ms':>13} | {'scrape p99 ms':>13} | {'loop share':>10} | {'bytes':>6} |")
    print("|" + "|".join("-" * (w + 2) for w in (8, 6, 10, 10, 14, 7, 13, 13, 10, 6)) + "|")
    for mode, runs in rows.items():
        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)
        print(f"| {mode:8} | {med('req_s'):6.0f} | {med('p50'):10.1f} | {med('p99'):10.1f} "
              f"| {med('peak_in_flight'):14.0f} | {med('scrapes'):7.0f} | {med('scrape_p50'):13.2f} "
              f"| {med('scrape_p99'):13.2f} | {med('scrape_share'):9.2%} | {med('bytes'):6.0f} |")
    ratio = (statistics.median(r["req_s"] for r in rows["scraped"])
             / statistics.median(r["req_s"] for r in rows["plain"]))
    from draftgen.core import runtime
    print(f"scraped / plain req/s {ratio:.2f}; load average {os.getloadavg()[0]:.1f}; simulator peak in flight "
          f"{sim_peak}; event loop {runtime.loop_name()}")


if __name__ == "__main__":
    main()
