"""Event-loop lag with the TUI on, 2,000 requests in flight, next to the same run headless.

    python benchmarks/bench_ui_lag.py [--n 16000] [--concurrency 2000] [--latency 2.0] [--views main,history,drill]

The simulator runs in its own process with a fixed latency, so 2,000 requests really are in
flight. Each mode runs the real Pipeline (engine, attach socket, snapshots at 4 Hz; reconstruction
off) in a fresh process; a probe task sleeps 10 ms at a time and records how late it wakes. In the
`tui` mode the real DraftgenApp runs on the same loop through Textual's headless driver
(`App.run_test`, 120x40): every panel is composed and rendered, only the terminal write is skipped.
Each `--views` entry is one tui row, with that view open the whole run: `main` (the panels),
`history` (key h: the history charts), `drill` (enter on the focused datasets panel: the
drill-down of the first dataset); the row names the screen that was really up at the end, so a
build without a view shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import KEY, free_port, sim_stats, start_sim  # noqa: E402


def write_config(root: Path, url: str, n: int, concurrency: int) -> Path:
    with open(root / "p.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt": f"Question {i}"}) + "\n")
    path = root / "c.toml"
    path.write_text(f"""
[api]
base_url = "{url}"
api_key_env = "BENCH_KEY"
[engine]
reconstruct = false
[output]
dir = "run"
[[datasets]]
name = "lag"
prompts = "p.jsonl"
concurrency = {concurrency}
max_tokens = 1024
""")
    return path


class LagProbe:
    """A task that sleeps 10 ms at a time on the run's loop and records how late it wakes (the event-loop
    lag), and the most requests in flight it saw."""

    def __init__(self, pipeline: Any) -> None:
        self.lags: list[float] = []
        self.peak = 0
        self._task = asyncio.create_task(self._run(pipeline))

    async def _run(self, pipeline: Any) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lags.append(time.perf_counter() - t - 0.01)
            self.peak = max(self.peak, pipeline.engine.in_flight)

    def stop(self) -> dict:
        """Lag p50, p99 and max in ms, and the peak in flight."""
        self._task.cancel()
        lags_ms = sorted(x * 1000 for x in self.lags) or [0.0]
        return {"p50": statistics.median(lags_ms), "p99": lags_ms[int(len(lags_ms) * 0.99)], "max": lags_ms[-1],
                "peak_in_flight": self.peak}


VIEW_KEYS = {"main": (), "history": ("h",), "drill": ("enter",)}


async def measure(mode: str, config_path: Path) -> dict:
    from draftgen.core.config_load import load_config
    from draftgen.core.run.pipeline import Pipeline
    config = load_config(config_path)
    pipeline = Pipeline(config, KEY, skip_smoke=True)
    await pipeline.start()
    probe = LagProbe(pipeline)
    start = time.perf_counter()
    screen = ""
    if mode != "headless":
        from draftgen.tui.app import DraftgenApp
        app = DraftgenApp(pipeline, title="bench")
        async with app.run_test(headless=True, size=(120, 40)) as pilot:
            if VIEW_KEYS[mode]:
                await pilot.pause(0.5)  # a first snapshot to drill into
                for key in VIEW_KEYS[mode]:
                    await pilot.press(key)
            await pipeline.generate()
            screen = type(app.screen).__name__
    else:
        await pipeline.generate()
    elapsed = time.perf_counter() - start
    lag = probe.stop()
    done = pipeline.engine.datasets["lag"].done
    await pipeline.close()
    return {"req_s": done / elapsed, **lag, "done": done, "screen": screen}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--latency", type=float, default=0.0,
                   help="fixed latency in s (all answers land in waves: a worst case); default: the "
                        "simulator's realistic, varied latency for short answers (~1-2 s)")
    p.add_argument("--views", default="main", help="comma-separated tui rows: main, history, drill")
    p.add_argument("--child")
    p.add_argument("--config")
    args = p.parse_args()
    if args.child:
        from draftgen.core import runtime  # the loop `draftgen run` runs on
        print(json.dumps(runtime.run(measure(args.child, Path(args.config)))))
        return
    os.environ["BENCH_KEY"] = KEY
    port = free_port()
    latency = ["--fixed-latency", str(args.latency)] if args.latency else ["--latency-scale", "1"]
    sim = start_sim(port, *latency)
    rows = {}
    try:
        for mode in ("headless", *args.views.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = write_config(Path(tmp), f"http://127.0.0.1:{port}/api/v1", args.n, args.concurrency)
                out = subprocess.run([sys.executable, __file__, "--child", mode, "--config", str(cfg)],
                                     capture_output=True, text=True, check=True)
                rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        sim_peak = sim_stats(port).get("peak_in_flight")
    finally:
        sim.terminate()
        sim.wait()
    how = f"fixed {args.latency} s" if args.latency else "realistic, varied"
    print(f"\nevent-loop lag, {args.concurrency} in flight (simulator latency {how}), {args.n} requests\n")
    print(f"| {'mode':26} | {'req/s':>7} | {'lag p50 ms':>10} | {'lag p99 ms':>10} | {'lag max ms':>10} "
          f"| {'peak in flight':>14} |")
    print(f"|{'-' * 28}|{'-' * 9}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 16}|")
    for mode, r in rows.items():
        name = mode if mode == "headless" else f"tui {mode} ({r['screen']})"
        print(f"| {name:26} | {r['req_s']:7.0f} | {r['p50']:10.1f} | {r['p99']:10.1f} | {r['max']:10.1f} "
              f"| {r['peak_in_flight']:14} |")
    for mode in rows:
        if mode != "headless":
            ratio = rows[mode]["req_s"] / rows["headless"]["req_s"]
            print(f"tui {mode}: req/s / headless {ratio:.2f} (target >= 0.90); lag p99 {rows[mode]['p99']:.1f} ms "
                  f"(target <= 50 ms)")
    from draftgen.core import runtime
    print(f"load average {os.getloadavg()[0]:.1f}; simulator peak in flight {sim_peak}; "
          f"event loop {runtime.loop_name()}")


if __name__ == "__main__":
    main()
