"""Engine throughput, memory and concurrency against the simulator, next to the references.

    python benchmarks/bench_engine.py [--n 20000] [--concurrency 2000] [--openai] [--pin] [--fsync-ab]

Each contender runs in its own process against the same simulator process (latency 0), so their
peak RSS is their own:
- bare:   a bare aiohttp loop (one session, connector sized to the concurrency, orjson) doing the
          same POSTs and parsing the bodies, nothing else;
- engine: draftgen's Engine (prompt file streamed, retries armed, every answer written to
          responses.jsonl and fsynced before its request finishes, every attempt on the spend ledger
          (3 lines: sent, generation id, settled; the sent line fsynced before the request leaves,
          group commit: one fsync in a thread for all the requests of the moment) with its worst case
          reserved from the simulator's endpoints listing, snapshots taken 4 times a second),
          reconstruction off; the run's files are in a temporary directory, so the fsyncs hit the
          disk of $TMPDIR (not tmpfs, or they cost nothing);
- engine + max_usd: the same with a `max_usd` ceiling set (every admission checked against it);
- engine, fsync a no-op (with --fsync-ab): the engine with os.fsync stubbed out in its process, run
  right after the engine row, so the two rows show what the fsyncs themselves cost on this disk;
- openai: openai-python's AsyncOpenAI (httpx) at the same concurrency (with --openai; slow).
Then the simulator is restarted with a fixed latency (2 s, or 1 s per 1,000 in flight above 2,000,
so that one simulator process can keep that many answers open) to measure the concurrency reached.
With --pin every client runs on CPU 0 only and the simulator on CPU 1 (the "one core" figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

BODY = {"model": "moonshotai/kimi-k2.5", "max_tokens": 1024, "temperature": 0.6, "include_reasoning": True}
KEY = "sk-bench-not-a-real-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "simulate", "--port", str(port),
                             "--seed", "1", "--mean-tokens", "40", "--credits", "1e9", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_sim/stats", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the simulator did not start")


def sim_stats(port: int) -> dict:
    import urllib.request
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/_sim/stats", timeout=5).read())


def child(mode: str, port: int, n: int, concurrency: int, pin: bool = False) -> dict:
    """Run one contender in a fresh interpreter; it prints one JSON line with its figures."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--port", str(port), "--n", str(n),
                          "--concurrency", str(concurrency), *(["--pin"] if pin else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def run_bare(url: str, n: int, concurrency: int) -> float:
    import aiohttp
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        async def worker(w: int) -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                body = {**BODY, "messages": [{"role": "user", "content": f"Question {remaining}"}]}
                async with session.post(f"{url}/chat/completions", data=orjson.dumps(body)) as resp:
                    obj = orjson.loads(await resp.read())
                    assert obj["choices"][0]["message"]["content"] is not None
        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return n / (time.perf_counter() - start)


async def run_openai(url: str, n: int, concurrency: int) -> float:
    import openai
    try:
        import httpx
    except ImportError:  # newer openai releases ship the httpx fork as `httpx2`
        import httpx2 as httpx
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # Generous timeouts: at 2,000 in flight its pool queues requests for tens of seconds.
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=httpx.Timeout(900.0),
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits,
                                                                           timeout=httpx.Timeout(900.0)))
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await client.chat.completions.create(
                model=BODY["model"], max_tokens=1024, temperature=0.6,
                messages=[{"role": "user", "content": f"Question {remaining}"}],
                extra_body={"include_reasoning": True})
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def run_engine(url: str, n: int, concurrency: int, max_usd: float | None = None) -> tuple[float, int]:
    from draftgen.core.config import load_config
    from draftgen.core.generate.engine import Engine
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with open(root / "p.jsonl", "wb") as f:
            for i in range(n):
                f.write(orjson.dumps({"id": i, "prompt": f"Question {i}"}) + b"\n")
        (root / "c.toml").write_text(f"""
[api]
base_url = "{url}"
api_key_env = "BENCH_KEY"
[request]
temperature = 0.6
include_reasoning = true
[engine]
reconstruct = false
{f"[budget]{chr(10)}max_usd = {max_usd}" if max_usd is not None else ""}
[output]
dir = "run"
[[datasets]]
name = "bench"
prompts = "p.jsonl"
concurrency = {concurrency}
max_tokens = 1024
""")
        config = load_config(root / "c.toml")
        engine = Engine(config, KEY)
        peak_in_flight = 0

        async def watch() -> None:  # what the TUI or headless line does: 4 snapshots a second
            nonlocal peak_in_flight
            while True:
                await asyncio.sleep(0.25)
                peak_in_flight = max(peak_in_flight, engine.snapshot().throughput.in_flight)
        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        await engine.run()
        elapsed = time.perf_counter() - start
        watcher.cancel()
        assert engine.datasets["bench"].done == n, engine.datasets["bench"].done
        assert engine.spend.reserved_usd == 0.0 and engine.spend.settled_usd > 0
        return n / elapsed, peak_in_flight


def child_main(args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{args.port}/api/v1"
    if args.pin:
        os.sched_setaffinity(0, {0})
    extra = {}
    if args.child in ("bare", "bare_gc"):
        if args.child == "bare_gc":
            from draftgen.core.generate.engine import tune_gc
            tune_gc()
        rate = asyncio.run(run_bare(url, args.n, args.concurrency))
    elif args.child == "openai":
        rate = asyncio.run(run_openai(url, args.n, args.concurrency))
    else:
        if args.child == "engine_nofsync":
            os.fsync = lambda fd: None  # the group commit as it is, minus the disk's part
        rate, peak = asyncio.run(run_engine(url, args.n, args.concurrency,
                                            1e6 if args.child == "engine_max_usd" else None))
        extra["peak_in_flight"] = peak
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rate": rate, "rss_mb": rss_mb, **extra}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--openai", action="store_true", help="also measure AsyncOpenAI (needs `pip install openai`)")
    p.add_argument("--pin", action="store_true", help="clients on CPU 0, the simulator on CPU 1")
    p.add_argument("--fsync-ab", action="store_true", help="also the engine with os.fsync a no-op")
    p.add_argument("--child")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    if args.child:
        child_main(args)
        return
    os.environ["BENCH_KEY"] = KEY
    port = free_port()
    sim = start_sim(port, "--latency-scale", "0")
    if args.pin:
        os.sched_setaffinity(sim.pid, {1})
    rows = []
    try:
        child("bare", port, 2000, args.concurrency)  # warm the simulator's pool and caches
        bare = child("bare", port, args.n, args.concurrency, args.pin)
        engine = child("engine", port, args.n, args.concurrency, args.pin)
        nofsync = child("engine_nofsync", port, args.n, args.concurrency, args.pin) if args.fsync_ab else None
        bare_gc = child("bare_gc", port, args.n, args.concurrency, args.pin)
        capped = child("engine_max_usd", port, args.n, args.concurrency, args.pin)
        rows.append(("bare aiohttp loop", bare["rate"], 1.0, bare["rss_mb"]))
        rows.append(("draftgen engine", engine["rate"], engine["rate"] / bare["rate"], engine["rss_mb"]))
        rows.append(("bare loop + engine's GC", bare_gc["rate"], bare_gc["rate"] / bare["rate"], bare_gc["rss_mb"]))
        rows.append(("engine + max_usd ceiling", capped["rate"], capped["rate"] / bare["rate"], capped["rss_mb"]))
        if nofsync is not None:
            rows.append(("engine, fsync a no-op", nofsync["rate"], nofsync["rate"] / bare["rate"], nofsync["rss_mb"]))
        if args.openai:
            oa = child("openai", port, min(args.n, 2000), args.concurrency)
            rows.append(("AsyncOpenAI (httpx)", oa["rate"], oa["rate"] / bare["rate"], oa["rss_mb"]))
    # The engine tunes the garbage collector (core/generate/engine.py tune_gc); the third row gives the bare
    # loop the same settings, so the engine's own overhead shows as engine / that row.
    finally:
        sim.terminate()
        sim.wait()
    port = free_port()
    hold_s = max(2.0, args.concurrency / 1000)
    sim = start_sim(port, "--fixed-latency", f"{hold_s:g}")
    if args.pin:
        os.sched_setaffinity(sim.pid, {1})
    try:
        conc = child("engine", port, args.concurrency * 3, args.concurrency, args.pin)
        peak = sim_stats(port).get("peak_in_flight", 0)
    finally:
        sim.terminate()
        sim.wait()

    print(f"\nengine vs references, {args.concurrency} in flight, simulator latency 0, {args.n} requests\n")
    print(f"| {'client':24} | {'req/s':>8} | {'vs bare':>8} | {'peak RSS MB':>11} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 10}|{'-' * 13}|")
    for name, rate, ratio, rss in rows:
        print(f"| {name:24} | {rate:8.0f} | {ratio:7.2f}x | {rss:11.0f} |")
    engine_rate = rows[1][1]
    if args.openai:
        print(f"\nengine / AsyncOpenAI: {engine_rate / rows[-1][1]:.1f}x (target >= 20x)")
    print(f"engine / bare: {rows[1][2]:.2f}x (target >= 0.9x); engine / bare with the same GC settings: "
          f"{engine_rate / rows[2][1]:.2f}x; engine peak RSS {rows[1][3]:.0f} MB "
          "(target <= 300 MB, no tokenizer loaded)")
    print(f"engine + max_usd (spend ledger and reservations, ceiling checked) / bare: {rows[3][2]:.2f}x (target >= 0.9x)")
    if nofsync is not None:
        print(f"engine (fsyncs) / engine with fsync a no-op: {engine_rate / nofsync['rate']:.2f}x")
    print(f"concurrency reached at {hold_s:g} s latency: simulator peak {peak} / configured {args.concurrency} = "
          f"{peak / args.concurrency:.3f} (target >= 0.98); engine's own peak in flight {conc['peak_in_flight']}")


if __name__ == "__main__":
    main()
