"""What one request of the engine waits on, counted, and what a wait costs (BENCHMARKS.md "Engine CPU per
request and throughput").

`python benchmarks/bench_waits.py count [--child engine_alone|engine] [--n 2000]` runs bench_engine.py's child
(against the simulator, on the standard library's event loop) at n and 2n requests and prints, per request,
the loop's callbacks by what they call (`call_soon`, `call_at`, `call_soon_threadsafe`), the futures and
executor jobs made, the tasks created, and the engine's coroutines started and resumed (`sys.setprofile`: a
coroutine's first step is told from its later ones by its frame's `f_lasti`). Counts, not times: the same
on a loaded machine.

`valgrind --tool=cachegrind --cache-sim=no python benchmarks/bench_waits.py cost wake|hop K` runs 2,000
coroutines on uvloop, each awaiting K futures resolved from a callback (`wake`) or K coroutines that return at
once (`hop`): K = 5 less K = 1, over 8,000, is the instructions of one wake, or of one coroutine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402

LOOP_METHODS = ("call_soon", "call_at", "call_soon_threadsafe", "create_future", "run_in_executor")


def _name(callback: Any) -> str:
    """What a callback calls: a task's step or wakeup named with its coroutine."""
    if isinstance(callback, functools.partial):
        return "partial " + getattr(callback.func, "__qualname__", "?")
    name = getattr(callback, "__qualname__", None) or type(callback).__name__
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        name += f" [task {getattr(owner.get_coro(), '__qualname__', '?')}]"
    return name


def count(child: str, n: int) -> None:
    os.environ["DRAFTGEN_EVENT_LOOP"] = "asyncio"  # the loop whose methods are Python, so they can be counted
    counts: Counter[tuple[str, str]] = Counter()
    loop_class: Any = asyncio.BaseEventLoop
    def counting(method: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, *args: Any, **kw: Any) -> Any:
            callback = args[1] if method == "call_at" else args[0] if args else None
            counts[(method, _name(callback) if method != "create_future" else "")] += 1
            return real(self, *args, **kw)
        return counted
    for method in LOOP_METHODS:
        setattr(loop_class, method, counting(method, getattr(loop_class, method)))
    real_task = loop_class.create_task

    def create_task(self: Any, coro: Any, **kw: Any) -> Any:
        counts[("create_task", getattr(coro, "__qualname__", "?"))] += 1
        return real_task(self, coro, **kw)
    loop_class.create_task = create_task

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_COROUTINE:
            step = "started" if frame.f_lasti < 10 else "resumed"
            counts[(f"coroutine {step}", f"{Path(code.co_filename).name}:{code.co_qualname}")] += 1

    port = bench_engine.free_port()
    sim = bench_engine.start_sim(port)
    try:
        url = f"http://127.0.0.1:{port}/api/v1"
        if child == "engine_alone":
            bench_engine.replay_answers(url)
        from draftgen.core import runtime

        def run(requests: int) -> Counter[tuple[str, str]]:
            counts.clear()
            sys.setprofile(profile)
            try:
                runtime.run(bench_engine.run_engine(url, requests, 2000))
            finally:
                sys.setprofile(None)
            return Counter(counts)
        small, big = run(n), run(2 * n)
    finally:
        sim.kill()
    print(f"{child}: per request ({2 * n} requests less {n})")
    for key in sorted(set(small) | set(big), key=lambda k: (k[0], small[k] - big[k])):
        per = (big[key] - small[key]) / n
        if abs(per) >= 0.01:
            print(f"{per:7.3f}  {key[0]:22s} {key[1]}")


def cost(mode: str, k: int) -> None:
    import uvloop

    async def at_once() -> None:
        return None

    async def worker(loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(k):
            if mode == "wake":
                fut = loop.create_future()
                loop.call_soon(fut.set_result, None)
                await fut
            else:
                await at_once()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(worker(loop) for _ in range(2000)))
    uvloop.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("count")
    c.add_argument("--child", choices=("engine_alone", "engine"), default="engine_alone")
    c.add_argument("--n", type=int, default=2000)
    w = sub.add_parser("cost")
    w.add_argument("mode", choices=("wake", "hop"))
    w.add_argument("k", type=int)
    args = p.parse_args()
    if args.what == "count":
        count(args.child, args.n)
    else:
        cost(args.mode, args.k)


if __name__ == "__main__":
    main()
