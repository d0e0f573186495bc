"""Client CPU per answer, streamed against non-streamed, at 2,000 in flight (target: streamed <= 2x).

    python benchmarks/bench_stream.py [--n 4000] [--concurrency 2000] [--tokens 2300] [--chunk-tokens 4]
                                      [--repeats 3]

The simulator (its own process, latency 0) answers ~2,300-token reasoning answers the way
OpenRouter does: non-streamed as one JSON body; streamed as one SSE event per `--chunk-tokens`
tokens (each event a whole `chat.completion.chunk` with `reasoning` and `reasoning_details`),
`: OPENROUTER PROCESSING` comments before and inside the stream, and a final chunk with `usage`.
draftgen's ChatClient (core/generate/api/client.py) sends the same requests with and without
`stream: true`, each phase in a fresh process; what is measured is that process's CPU time
(user + system, `time.process_time`) over the requests, divided by the answers. The modes
alternate (plain, stream, plain, stream, ...) so load on the shared machine falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import KEY, free_port, sim_stats, start_sim  # noqa: E402

BODY = {"model": "moonshotai/kimi-k2.5", "max_tokens": 16384, "temperature": 0.6, "include_reasoning": True}


async def run_client(url: str, n: int, concurrency: int, stream: bool) -> dict:
    from draftgen.core.generate.api.client import ChatClient
    from draftgen.core.generate.api.limits import tune_gc
    tune_gc()  # as the engine runs it
    remaining = n
    chars = tokens = 0
    async with ChatClient(url, KEY, concurrency=concurrency) as client:
        async def worker() -> None:
            nonlocal remaining, chars, tokens
            while remaining > 0:
                remaining -= 1
                body = {**BODY, "stream": stream, "messages": [{"role": "user", "content": f"Question {remaining}"}]}
                answer = await client.chat(body)
                chars += len(answer.content) + len(answer.reasoning or "")
                tokens += answer.usage.completion_tokens
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_ms": cpu * 1000 / n, "wall_s": wall, "chars": chars / n, "tokens": tokens / n}


def child(mode: str, port: int, n: int, concurrency: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--port", str(port), "--n", str(n),
                          "--concurrency", str(concurrency)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=2800,
                   help="the simulator's --mean-tokens (2,800 gives answers of ~2,300 completion tokens)")
    p.add_argument("--chunk-tokens", type=int, default=4, help="tokens per SSE event")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}/api/v1"
    if args.child:
        print(json.dumps(asyncio.run(run_client(url, args.n, args.concurrency, args.child == "stream"))))
        return
    os.environ["BENCH_KEY"] = KEY
    port = free_port()
    sim = start_sim(port, "--latency-scale", "0", "--mean-tokens", str(args.tokens),
                    "--chunk-tokens", str(args.chunk_tokens))
    runs: dict[str, list[dict]] = {"plain": [], "stream": []}
    try:
        child("stream", port, min(args.n, 1000), args.concurrency)  # warm the simulator's caches
        child("plain", port, min(args.n, 1000), args.concurrency)
        for _ in range(args.repeats):
            for mode in ("plain", "stream"):
                runs[mode].append(child(mode, port, args.n, args.concurrency))
        stats = sim_stats(port)
    finally:
        sim.terminate()
        sim.wait()
    load = os.getloadavg()
    plain_cpu = statistics.median(r["cpu_ms"] for r in runs["plain"])
    print(f"\nclient CPU per answer, {args.concurrency} in flight, {args.n} answers a run, mean "
          f"{statistics.mean(r['tokens'] for r in runs['stream']):.0f} completion tokens "
          f"({statistics.mean(r['chars'] for r in runs['stream']):.0f} chars), {args.chunk_tokens} tokens per SSE "
          f"event, load average {load[0]:.1f}; simulator peak in flight {stats.get('peak_in_flight')}\n")
    print(f"| {'mode':12} | {'CPU ms/answer (each run)':30} | {'median':>7} | {'vs plain':>8} |")
    print(f"|{'-' * 14}|{'-' * 32}|{'-' * 9}|{'-' * 10}|")
    for mode, label in (("plain", "non-streamed"), ("stream", "streamed")):
        each = ", ".join(f"{r['cpu_ms']:.2f}" for r in runs[mode])
        med = statistics.median(r["cpu_ms"] for r in runs[mode])
        print(f"| {label:12} | {each:30} | {med:7.2f} | {med / plain_cpu:7.2f}x |")
    ratios = [s["cpu_ms"] / pl["cpu_ms"] for s, pl in zip(runs["stream"], runs["plain"])]
    print(f"\nstreamed / non-streamed per pair: {', '.join(f'{r:.2f}' for r in ratios)} (target <= 2x)")


if __name__ == "__main__":
    main()
