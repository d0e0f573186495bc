"""Memory per answer of a long run: what the main process keeps for each answer it has written.

    python benchmarks/bench_memory.py [--n 40000] [--concurrency 2000] [--latency 0.5] [--trace] [--top 12]

A run's memory must be bounded by what is in flight plus a compact set of the answered ids (the
prompt source's ids on disk, the duplicates check across datasets). This runs the pipeline as
`draftgen run --headless` does (reconstruction off unless --reconstruct, snapshots four times a second as the headless
line and the TUI take them) on --n prompts at --concurrency in flight against the simulator in its
own process (--latency s a request, 1% of them 429s). Between the answers N/4 and 0.9 N (in flight
alike at both) it reads the process's RSS after a full collection and prints its growth per answer,
and the peak RSS. With --trace, tracemalloc is on and it also prints the traced Python heap's growth
per answer, the part of it made on the lines that keep answered ids (a set's `ids.add(`,
`known.add(` or `seen.add(`, duplicates.py), the rest ("beyond the id sets", the figure the target
bounds: <= 0.2 KB) and the lines whose allocations grew most. Where the C library is glibc it also prints its
heap's growth per answer between the two marks (`mallinfo2`, every arena: bytes in use, and bytes free inside
its heaps, which the RSS holds and tracemalloc does not see: fragmentation). The run's files are in a temporary
directory.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import linecache
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import psutil
from bench_engine import KEY, free_port, start_sim
from run_files import write_run

from draftgen.core.tokens.tokenizer import bundled_kimi_path

ROOT = Path(__file__).resolve().parents[1]
# The lines that keep the answered ids: a set's add (the dataset's done_ids, the prompt reader's seen, the
# token writer's ids, the live reconstruction's known), or the duplicates check (duplicates.py). The id
# strings themselves are allocated where the prompt line is parsed (with the rest of it): not counted here.
ID_SET_FILE = "core/generate/loop/duplicates.py"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_figures() -> tuple[int, int] | None:
    """glibc's heap as `mallinfo2` sees it, every arena: (bytes in use, bytes free inside the heaps), or
    None where it is not glibc. Memory the RSS holds that tracemalloc does not see shows here as free
    bytes the allocator kept (fragmentation) or as bytes in use outside Python's own allocators."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    info = fn()
    return info.uordblks + info.hblkhd, info.fordblks


def _is_id_set(trace: tracemalloc.StatisticDiff) -> bool:
    frame = trace.traceback[0]
    line = linecache.getline(frame.filename, frame.lineno)
    return frame.filename.endswith(ID_SET_FILE) or any(f"{name}.add(" in line for name in ("ids", "known", "seen"))


async def measure(config_path: Path, n: int, top: int, trace: bool) -> dict:
    from draftgen.core.config_load import load_config
    from draftgen.core.run.pipeline import Pipeline
    config = load_config(config_path)
    pipeline = Pipeline(config, KEY, skip_smoke=True, serve_attach=False)
    await pipeline.start()
    marks: dict[str, tuple[int, int, tracemalloc.Snapshot]] = {}

    def answered() -> int:
        return pipeline.engine.datasets["bench"].done

    async def watch() -> None:  # the headless line's snapshots, and the two measures
        while True:
            await asyncio.sleep(0.25)
            pipeline.snapshot()
            a = answered()
            for name, at in (("first", n // 4), ("last", n * 9 // 10)):
                if name not in marks and a >= at:
                    gc.collect()
                    rss = proc.memory_info().rss
                    heaps[name] = malloc_figures()
                    tokens = pipeline.snapshot().stage("tokens")
                    queued[name] = dict(tokens.detail).get("waiting", "0") if tokens is not None else "-"
                    if trace:
                        marks[name] = (answered(), rss, tracemalloc.get_traced_memory()[0],
                                       tracemalloc.take_snapshot())
                    else:
                        marks[name] = (answered(), rss, 0, None)

    proc = psutil.Process()
    heaps: dict[str, tuple[int, int] | None] = {}  # malloc_figures() at each measure
    queued: dict[str, str] = {}  # answers waiting for token reconstruction at each measure
    if trace:
        tracemalloc.start(1)
    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    try:
        await pipeline.generate()
    finally:
        watcher.cancel()
        await pipeline.close()
    elapsed = time.perf_counter() - start
    (a0, r0, m0, s0), (a1, r1, m1, s1) = marks["first"], marks["last"]
    span = a1 - a0
    out = {"queued": queued, "n": n, "answered": answered(), "elapsed_s": elapsed, "from": a0, "to": a1,
           "rss_b": (r1 - r0) / span, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "top": [], "heap": None}
    h0, h1 = heaps["first"], heaps["last"]
    if h0 is not None and h1 is not None:
        out["heap"] = ((h1[0] - h0[0]) / span, (h1[1] - h0[1]) / span)
    if trace:
        tracemalloc.stop()
        assert s0 is not None and s1 is not None
        diffs = [d for d in s1.compare_to(s0, "lineno") if d.size_diff]
        ids = sum(d.size_diff for d in diffs if _is_id_set(d)) / span
        out.update(per_answer_b=(m1 - m0) / span, id_sets_b=ids, beyond_b=(m1 - m0) / span - ids,
                   top=[(_where(d.traceback[0].filename, d.traceback[0].lineno), d.size_diff / span, d.count_diff)
                        for d in diffs[:top]])
    return out


def _where(filename: str, line: int) -> str:
    """A traced line, relative to the checkout or to site-packages."""
    for root in (str(ROOT) + "/", "site-packages/"):
        if root in filename:
            filename = filename.split(root, 1)[1]
    return f"{filename}:{line}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40_000, help="prompts (default 40,000, the issue's run)")
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--latency", type=float, default=0.5, help="seconds a request takes (default 0.5)")
    p.add_argument("--top", type=int, default=12, help="lines whose allocations grew most, shown")
    p.add_argument("--reconstruct", action="store_true",
                   help="live token reconstruction on (one worker process; the run's default), not off")
    p.add_argument("--trace", action="store_true",
                   help="tracemalloc on: the traced heap's growth, the id sets' part, the lines (slower; its "
                        "first snapshot is kept, so the RSS figure is then not the run's own)")
    args = p.parse_args()
    port = free_port()
    sim = start_sim(port, "--fixed-latency", str(args.latency), "--faults", "429=0.01")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            import os
            os.environ["BENCH_KEY"] = KEY
            config = write_run(Path(tmp), f"http://127.0.0.1:{port}/api/v1", dataset="bench", n=args.n,
                               concurrency=args.concurrency, max_tokens=1024, request_timeout_s=60,
                               tables={"engine": {"reconstruct": args.reconstruct, "workers": 1},
                                       "tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}})
            r = asyncio.run(measure(config, args.n, args.top, args.trace))
    finally:
        sim.kill()
        sim.wait()
    print(f"{r['answered']:,} of {r['n']:,} answered in {r['elapsed_s']:.0f} s at {args.concurrency:,} in flight; "
          f"measured between answers {r['from']:,} and {r['to']:,} (waiting for token ids then: "
          f"{r['queued']['first']} and {r['queued']['last']})")
    print("| RSS growth per answer | traced heap per answer | of it the id sets | beyond the id sets | peak RSS |")
    print("|---:|---:|---:|---:|---:|")
    traced = (f"{r['per_answer_b']:.0f} B | {r['id_sets_b']:.0f} B | {r['beyond_b']:.0f} B" if args.trace
              else "(--trace) | | ")
    print(f"| {r['rss_b']:.0f} B | {traced} | {r['peak_rss_mb']:.0f} MB |")
    if r["heap"] is not None:
        print(f"glibc malloc (mallinfo2, every arena) per answer: in use {r['heap'][0]:+.0f} B, "
              f"free inside its heaps {r['heap'][1]:+.0f} B")
    if r["top"]:
        print("\nlines whose allocations grew most (bytes per answer, blocks):")
        for where, size, count in r["top"]:
            print(f"  {size:8.1f} B  {count:+8,}  {where}")
    sys.exit(0)


if __name__ == "__main__":
    main()
