"""Engine throughput, memory and concurrency against the simulator, next to the references.

    python benchmarks/bench_engine.py [--n 20000] [--concurrency 2000] [--openai] [--pin] [--fsync-ab]
                                      [--rounds R] [--rows bare,engine] [--no-concurrency] [--mean-tokens 40]

Each contender runs in its own process against the same simulator process (latency 0), so their
peak RSS is their own:
- bare:   a bare aiohttp loop (one session, connector sized to the concurrency, orjson) doing the
          same POSTs, parsing the bodies and writing each answer's line (id, text, reasoning, usage)
          to a file with one unbuffered write, nothing else (no fsync, no retry, no money);
- engine: draftgen's Engine (prompt file streamed, retries armed, every answer written to
          responses.jsonl and fsynced before its request finishes, every attempt on the spend ledger
          (3 lines: sent, generation id, settled; the sent line fsynced before the request leaves,
          group commit: one fsync in a thread for all the requests of the moment) with its worst case
          reserved from the simulator's endpoints listing, snapshots taken 4 times a second),
          reconstruction off; the run's files are in a temporary directory, so the fsyncs hit the
          disk of $TMPDIR (not tmpfs, or they cost nothing); on the event loop `draftgen run` runs on
          (core/runtime.py: uvloop where installed);
- engine + max_usd: the same with a `max_usd` ceiling set (every admission checked against it);
- engine, 3-turn convs (engine_mt): the engine on n / 3 ShareGPT conversations of 3 user turns with
  `turns = "all"` (core/generate/loop/conversations.py): the same n requests, each turn asked once its
  previous turn's answer is on disk, its request carrying the target's earlier answers (history of up
  to 2 answers), so its CPU per request is per turn; the simulator counts each history's prompt tokens;
- engine, fsync a no-op (with --fsync-ab): the engine with os.fsync stubbed out in its process, run
  right after the engine row, so the two rows show what the fsyncs themselves cost on this disk;
- engine, own work (engine_alone; engine_alone_ab for the --ab-code checkout): the engine with the HTTP
  exchange replaced by one answer of the simulator's, fetched before the run and replayed (the client
  still encodes each body, decodes, parses and redacts each answer, and hears a new generation id
  each time): what is left is the engine's
  own work per request, E, without aiohttp's and the kernel's share, whose noise (each round's batching)
  hides changes of a few per cent in the other rows: the row for an A/B of the engine's own code. (Its
  exchange costs less than the bare loop's aiohttp one, by the per-request timer the engine's deadlines
  do without (core/generate/api/deadlines.py): so the 1.2x target is no longer exactly E <= 0.2x the tuned
  bare loop's CPU; the target is read on the engine row);
- engine, reconstruct on (engine_tokens; engine_tokens_ab for the --ab-code checkout): the engine with
  `[engine] reconstruct = true`, each answer handed to the tokens stage as `draftgen run` does
  (core/run/tokens_stage.py: the real Kimi-K2 tokenizer, worker processes, the token store), the run
  over once the last answer's ids are written. Its CPU per request counts every process of the run: the
  main one and its descendants (the token workers, their forkserver and resource tracker, read from
  /proc before the workers exit); the engine starts once the workers are ready, so the start-up's CPU
  (the tokenizer loaded in the main process and in each worker) is also given apart. A table then
  compares it with the engine row (reconstruction off) in the same rounds: CPU per answer on / off with
  the start-up and after it, main process and workers apart, wall time / the bare loop's. Use
  --mean-tokens to size the answers (e.g. 100: answers of ~25-150 words);
- openai: openai-python's AsyncOpenAI (httpx) at the same concurrency (with --openai; slow).
Then the simulator is restarted with a fixed latency (2 s, or 1 s per 1,000 in flight above 2,000,
so that one simulator process can keep that many answers open) to measure the concurrency reached.
With --pin every client runs on CPU 0 only and the simulator on CPU 1 (the "one core" figure).

Besides req/s each row gives the client's CPU per request: its process CPU time (user + system, every
thread: `time.process_time`) over the run, divided by the requests; the simulator's CPU is its own
process's, not counted. "CPU vs bare" is the bare loop's CPU per request over the row's (above 1: the
row spends less CPU per request than the bare loop). On a shared machine req/s follows the load more
than CPU per request does. --rounds R runs the rows R times, one of each in turn (bare, engine, ...:
alternating, so a change of load hits them alike), and gives each figure's median over the rounds;
--rows picks the rows (bare, engine, engine_nofsync, bare_gc, engine_max_usd, engine_mt, engine_ab, engine_tokens,
engine_tokens_ab, bare_uv,
engine_asyncio: the bare loop on uvloop, the engine on asyncio's own loop, so what the event loop
and what the engine's code each save is seen apart; bare_tuned: the bare loop on the engine's event
loop with the engine's GC settings, the reference of "engine CPU per request / tuned bare", given
per round with its median, min and max); --no-concurrency
skips the concurrency check. With --ab-code DIR the _ab rows (engine_ab, engine_alone_ab,
engine_tokens_ab) are the engine of another checkout, measured in the same rounds as this one's: DIR is
a checkout or a `git archive` of one (a folder with `draftgen/__init__.py` and links to DIR's `core`,
`tui`, ... is put first on the row's PYTHONPATH, where it wins over the editable install's finder), or a
folder holding a `draftgen` link to one; each such row stops the benchmark unless its draftgen.core is
DIR's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

MT_TURNS = 3  # the engine_mt row: conversations of this many user turns
BODY = {"model": "moonshotai/kimi-k2.5", "max_tokens": 1024, "temperature": 0.6, "include_reasoning": True}
KEY = "sk-bench-not-a-real-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(port: int, *extra: str, mean_tokens: int = 40) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "simulate", "--port", str(port),
                             "--seed", "1", "--mean-tokens", str(mean_tokens), "--credits", "1e9", *extra],
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


PACKAGES = ("core", "tui", "cli", "simulator", "headless")  # pyproject.toml's package-dir: draftgen.<folder>
CODE_ENV = "BENCH_CODE"  # a child given --ab-code's checkout checks that its draftgen.core lies under this


def code_path(code: str, tmp: Path) -> str:
    """The folder to put first on a child's PYTHONPATH so that it imports `code`'s draftgen: a checkout (or a
    `git archive` of one) has no `draftgen/` folder (pyproject.toml maps `core`, `tui`, ... to
    `draftgen.<folder>`), so a folder is made in `tmp` holding `draftgen/__init__.py` and a link
    `draftgen/<folder>` to each of code's. A regular package found on the path wins over the editable
    install's finder, which setuptools appends to sys.meta_path after the path's own (the path is searched
    first, and `draftgen.core` is then looked up in that package's folder only). A folder already holding a
    `draftgen` package (or a link to a checkout) is used as it is."""
    root = Path(code).resolve()
    if (root / "draftgen" / "core").is_dir():
        return str(root)
    if not (root / "core" / "__init__.py").is_file():
        raise SystemExit(f"--ab-code {code}: neither a checkout (core/__init__.py) nor a folder holding draftgen/")
    folder = tmp / "draftgen"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name in PACKAGES:
        if (root / name).is_dir():
            (folder / name).symlink_to(root / name, target_is_directory=True)
    return str(folder.parent)


def check_code() -> None:
    """In a child given another checkout's code: stop, loudly, unless draftgen.core is that checkout's."""
    want = os.environ.get(CODE_ENV)
    if not want:
        return
    import draftgen.core
    got = Path(draftgen.core.__file__).resolve()
    if not got.is_relative_to(Path(want).resolve()):
        raise SystemExit(f"--ab-code: this row imported draftgen.core from {got}, not from {want}")


def child(mode: str, port: int, n: int, concurrency: int, pin: bool = False, code: str | None = None) -> dict:
    """Run one contender in a fresh interpreter; it prints one JSON line with its figures. `code`: a folder
    holding another checkout's `draftgen` package (`code_path`), imported instead of this checkout's (the
    `_ab` rows); the child checks that it was (`check_code`)."""
    env = None
    if code:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (code, os.environ.get("PYTHONPATH")))),
               CODE_ENV: str((Path(code) / "draftgen" / "core").resolve().parent)}
    if mode == "engine_asyncio":  # the engine on the standard library's loop (core/runtime.py LOOP_ENV)
        env, mode = {**os.environ, "DRAFTGEN_EVENT_LOOP": "asyncio"}, "engine"
    out = subprocess.run([sys.executable, __file__, "--child", {"engine_ab": "engine",
                                                                 "engine_alone_ab": "engine_alone",
                                                                 "engine_tokens_ab": "engine_tokens"}.get(mode, mode),
                          "--port", str(port), "--n", str(n),
                          "--concurrency", str(concurrency), *(["--pin"] if pin else [])],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"the {mode} row failed (exit {out.returncode}):\n{out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


async def run_bare(url: str, n: int, concurrency: int) -> tuple[float, float]:
    import aiohttp
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    # What a minimal correct client does: send, read the JSON, write the answer's line to a file (one
    # write per answer, no fsync: the engine's durability is its own cost, measured in its row). Timed
    # like the engine's row: from before its session opens to after it closes (closing 2,000 connections
    # costs ~50 ms of CPU, which the engine's `run()` pays too).
    start, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "answers.jsonl", "ab", buffering=0) as out:
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            async def worker(w: int) -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    prompt_id = remaining
                    body = {**BODY, "messages": [{"role": "user", "content": f"Question {prompt_id}"}]}
                    async with session.post(f"{url}/chat/completions", data=orjson.dumps(body)) as resp:
                        obj = orjson.loads(await resp.read())
                    message = obj["choices"][0]["message"]
                    out.write(orjson.dumps({"id": prompt_id, "content": message["content"],
                                            "reasoning": message.get("reasoning"), "usage": obj.get("usage")},
                                           option=orjson.OPT_APPEND_NEWLINE))
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return n / (time.perf_counter() - start), time.process_time() - cpu


async def run_openai(url: str, n: int, concurrency: int) -> tuple[float, float]:
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
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start), time.process_time() - cpu


def write_conversations(path: Path, n: int, turns: int) -> None:
    """n requests as conversations of `turns` user turns (ShareGPT lines with the dataset's own answers,
    which a turns = "all" dataset drops): n / turns conversations."""
    with open(path, "wb") as f:
        for i in range(n // turns):
            conv = []
            for k in range(1, turns + 1):
                conv += [{"from": "human", "value": f"Question {k} of conversation {i}"},
                         {"from": "gpt", "value": f"The dataset's answer {k}"}]
            f.write(orjson.dumps({"id": f"c{i}", "conversations": conv}) + b"\n")


def descendants_cpu() -> float:
    """CPU seconds (user + system) of this process's live descendants: the token workers, the forkserver
    they are forked from and multiprocessing's resource tracker (read from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command's name, which may hold spaces
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    total, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


async def run_engine(url: str, n: int, concurrency: int, max_usd: float | None = None,
                     turns: int = 1, reconstruct: bool = False) -> tuple[float, float, int, float, tuple[float, float]]:
    """The engine on n single-turn prompts, or (turns > 1) on n / turns conversations of `turns` user turns
    asked turn by turn (`turns = "all"`: each turn's request carries the target's earlier answers).
    `reconstruct`: each answer is also turned into token ids as it lands, as `draftgen run` does with
    `[engine] reconstruct = true` (core/run/tokens_stage.py: worker processes, the token store written
    by the main process), its CPU counted from the stage's start (its tokenizer loaded, its workers
    started) to its last answer's ids written. The engine starts once the workers are ready, so the
    start-up's CPU (the tokenizer loaded in the main process and in each worker, the workers' imports) is
    measured apart, and the wall time (req/s) is the run's from there.
    Returns req/s, the main process's CPU seconds, the peak in flight, the CPU seconds of its descendants
    (the token workers, their forkserver and resource tracker) and the start-up's CPU seconds (the main
    process's, its descendants')."""
    from draftgen.core.config_load import load_config
    from draftgen.core.generate.loop.engine import Engine
    from draftgen.core.rundir import RunDir
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if turns > 1:
            n -= n % turns
            write_conversations(root / "p.jsonl", n, turns)
        else:
            with open(root / "p.jsonl", "wb") as f:
                for i in range(n):
                    f.write(orjson.dumps({"id": i, "prompt": f"Question {i}"}) + b"\n")
        tokenizer = ""
        if reconstruct:  # the real Kimi-K2 vocabulary draftgen bundles
            from draftgen.core.tokens.tokenizer import bundled_kimi_path
            tokenizer = f"[tokenizer]\npath = {json.dumps(str(bundled_kimi_path()))}\n"
        (root / "c.toml").write_text(f"""{tokenizer}
[api]
base_url = "{url}"
api_key_env = "BENCH_KEY"
[request]
temperature = 0.6
include_reasoning = true
[engine]
reconstruct = {"true" if reconstruct else "false"}
{f"[budget]{chr(10)}max_usd = {max_usd}" if max_usd is not None else ""}
[output]
dir = "run"
[[datasets]]
name = "bench"
prompts = "p.jsonl"
concurrency = {concurrency}
max_tokens = 1024
{'turns = "all"' if turns > 1 else ""}
""")
        config = load_config(root / "c.toml")
        rundir = RunDir(config.run_dir)
        stage = None
        if reconstruct:  # as core/run/pipeline.py wires it: each answer on disk handed to the stage
            from draftgen.core.run.stage_rows import StageRows
            from draftgen.core.run.tokens_stage import TokensStage
            stage = TokensStage(config, lambda *a, **k: None, StageRows(), rundir)
        engine = Engine(config, KEY, on_answer=stage.submit if stage is not None else None, rundir=rundir)
        peak_in_flight = 0

        async def watch() -> None:  # what the TUI or headless line does: 4 snapshots a second
            nonlocal peak_in_flight
            while True:
                await asyncio.sleep(0.25)
                peak_in_flight = max(peak_in_flight, engine.snapshot().throughput.in_flight)
                if stage is not None:
                    stage.refresh()  # the tokens row and the fidelity figures, as the pipeline's ticker asks
        watcher = asyncio.create_task(watch())
        start, cpu, cpu_below = time.perf_counter(), time.process_time(), descendants_cpu()
        startup = (0.0, 0.0)
        if stage is not None:
            await stage.start()
            reconstructor = stage._reconstructor
            assert reconstructor is not None
            if reconstructor._restart is not None:  # its workers ready (in a run they start beside the requests)
                await reconstructor._restart
            startup = (time.process_time() - cpu, descendants_cpu() - cpu_below)
            start = time.perf_counter()  # the wall time is the run's from here (the start-up's CPU is counted)
        await engine.run()
        if stage is not None:
            await reconstructor.wait_idle()
            cpu_below = descendants_cpu() - cpu_below  # before the workers exit: their CPU is gone with them
            assert await stage.finish(), "some answer has no token ids"
            report = reconstructor.report(None)
            assert report.checked == n, report.format()
        else:
            cpu_below = 0.0
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        watcher.cancel()
        assert engine.datasets["bench"].done == n, engine.datasets["bench"].done
        assert engine.spend.reserved_usd == 0.0 and engine.spend.settled_usd > 0
        return n / elapsed, cpu, peak_in_flight, cpu_below, startup


def replay_answers(url: str) -> None:
    """engine_alone: ChatClient.chat answers every request with one answer of the simulator's, fetched
    here before the run, replayed after one turn of the event loop (the rest of chat's work as it is:
    the body encoded, the answer decoded, parsed and redacted, its generation id heard). No request of
    the run goes over HTTP."""
    import urllib.request

    from draftgen.core.generate.api import client as cl
    try:
        from draftgen.core.generate.api.answer import ChatAnswer, parse_completion, redacted_answer
    except ImportError:  # an --ab-code checkout from before api/answer.py: the client parsed its answers
        ChatAnswer, parse_completion, redacted_answer = cl.ChatAnswer, cl.parse_completion, cl.redacted_answer
    body = {**BODY, "messages": [{"role": "user", "content": "Question 0"}]}
    ask = urllib.request.Request(f"{url}/chat/completions", data=orjson.dumps(body), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=30) as resp:
        raw, gen_id = resp.read(), resp.headers["X-Generation-Id"]
    sent = itertools.count()

    async def chat(self: cl.ChatClient, body: dict, on_generation=None, *, details: bool = False) -> ChatAnswer:
        start = time.monotonic()
        orjson.dumps(body)
        # The exchange (under its deadline: an --ab-code checkout from before deadlines.py has aiohttp's);
        # its headers and body then come in one read.
        with getattr(self, "_deadlines", None) or contextlib.nullcontext():
            await asyncio.sleep(0)
        if on_generation is not None:  # a new id each time, as in a run (the Redactor checks each once)
            on_generation(self._redact(f"{gen_id}-{next(sent)}"))
        # the run's server profile (an --ab-code checkout from before core/server_kinds.py: its callback)
        server = self._server if hasattr(self, "_server") else getattr(self, "_self_hosted", None)
        answer = parse_completion(orjson.loads(raw), time.monotonic() - start, server)
        assert answer.usage.completion_tokens <= cl.body_max_tokens(body, 0)  # chat's check of the cap, as it runs
        return redacted_answer(answer, self._redact)
    cl.ChatClient.chat = chat  # type: ignore[method-assign]


def child_main(args: argparse.Namespace) -> None:
    check_code()
    url = f"http://127.0.0.1:{args.port}/api/v1"
    if args.pin:
        os.sched_setaffinity(0, {0})
    extra = {}
    if args.child in ("bare", "bare_gc", "bare_uv", "bare_tuned"):
        if args.child in ("bare_gc", "bare_tuned"):
            from draftgen.core.generate.api.limits import tune_gc
            tune_gc(args.concurrency)  # as the engine runs it
        if args.child in ("bare_uv", "bare_tuned"):  # the bare loop on the engine's event loop (core/runtime.py)
            from draftgen.core import runtime
            rate, cpu = runtime.run(run_bare(url, args.n, args.concurrency))
        else:
            rate, cpu = asyncio.run(run_bare(url, args.n, args.concurrency))
    elif args.child == "openai":
        rate, cpu = asyncio.run(run_openai(url, args.n, args.concurrency))
    else:
        if args.child == "engine_nofsync":
            os.fsync = lambda fd: None  # the group commit as it is, minus the disk's part
        if args.child == "engine_alone":
            replay_answers(url)
        from draftgen.core import runtime  # the loop `draftgen run` runs on
        rate, cpu, peak, cpu_below, startup = runtime.run(run_engine(url, args.n, args.concurrency,
                                                            1e6 if args.child == "engine_max_usd" else None,
                                                            MT_TURNS if args.child == "engine_mt" else 1,
                                                            args.child in ("engine_tokens", "engine_tokens_ab")))
        # CPU per answer counts every process of the run: the token workers' share too.
        extra["main_cpu_us"] = cpu / args.n * 1e6
        extra["workers_cpu_us"] = cpu_below / args.n * 1e6
        extra["startup_cpu_s"] = sum(startup)
        extra["main_startup_s"] = startup[0]  # the main process's share of it (the rest: the workers')
        cpu += cpu_below
        args.n -= args.n % MT_TURNS if args.child == "engine_mt" else 0  # the requests it sent
        extra["loop"] = runtime.loop_name()
        extra["peak_in_flight"] = peak
        import draftgen.core
        extra["code"] = str(Path(draftgen.core.__file__).resolve().parents[1])  # which checkout's engine ran
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rate": rate, "rss_mb": rss_mb, "cpu_us": cpu / args.n * 1e6, "n": args.n, **extra}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=2000)
    p.add_argument("--openai", action="store_true", help="also measure AsyncOpenAI (needs `pip install openai`)")
    p.add_argument("--pin", action="store_true", help="clients on CPU 0, the simulator on CPU 1")
    p.add_argument("--fsync-ab", action="store_true", help="also the engine with os.fsync a no-op")
    p.add_argument("--rounds", type=int, default=1, help="run the rows this many times in turn; medians")
    p.add_argument("--rows", help="comma-separated rows, bare first (default: all)")
    p.add_argument("--no-concurrency", action="store_true", help="skip the concurrency check")
    p.add_argument("--ab-code", help="the _ab rows import draftgen from this checkout (e.g. a `git archive` "
                   "of an old commit) or from a folder holding a `draftgen` link to one")
    p.add_argument("--mean-tokens", type=int, default=40,
                   help="the simulator's mean completion tokens an answer, reasoning included (default 40)")
    p.add_argument("--child")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    if args.child:
        child_main(args)
        return
    os.environ["BENCH_KEY"] = KEY
    ab_tmp = tempfile.TemporaryDirectory(prefix="bench-ab-")
    ab_code = code_path(args.ab_code, Path(ab_tmp.name)) if args.ab_code else None
    port = free_port()
    sim = start_sim(port, "--latency-scale", "0", mean_tokens=args.mean_tokens)
    if args.pin:
        os.sched_setaffinity(sim.pid, {1})
    names = {"bare": "bare aiohttp loop", "engine": "draftgen engine", "bare_gc": "bare loop + engine's GC",
             "bare_uv": "bare loop on uvloop", "engine_asyncio": "engine on asyncio's loop",
             "engine_max_usd": "engine + max_usd ceiling", "engine_nofsync": "engine, fsync a no-op",
             "engine_ab": "engine, --ab-code", "bare_tuned": "bare loop, uvloop + GC",
             "engine_mt": f"engine, {MT_TURNS}-turn convs", "engine_alone": "engine, own work",
             "engine_alone_ab": "own work, --ab-code", "engine_tokens": "engine, reconstruct on",
             "engine_tokens_ab": "reconstruct on, --ab-code"}
    order = args.rows.split(",") if args.rows else \
        ["bare", "engine", *(["engine_nofsync"] if args.fsync_ab else []), "bare_gc", "engine_max_usd", "engine_mt"]
    ab_rows = {"engine_ab", "engine_alone_ab", "engine_tokens_ab"} & set(order)
    if order[0] != "bare" or any(m not in names for m in order) or bool(ab_rows) != bool(args.ab_code):
        raise SystemExit(f"--rows: a comma-separated list starting with bare, of {', '.join(names)} "
                         "(engine_ab or engine_alone_ab with --ab-code, and only then)")
    runs: dict[str, list[dict]] = {m: [] for m in order}
    try:
        child("bare", port, 2000, args.concurrency)  # warm the simulator's pool and caches
        for r in range(args.rounds):
            for m in order:
                runs[m].append(child(m, port, args.n, args.concurrency, args.pin,
                                     ab_code if m in ab_rows else None))
            if args.rounds > 1:
                print(f"round {r + 1}: " + ", ".join(f"{m} {runs[m][-1]['rate']:.0f} req/s "
                                                      f"{runs[m][-1]['cpu_us']:.0f} us/req" for m in order),
                      flush=True)
        for mine, other in (("engine", "engine_ab"), ("engine_alone", "engine_alone_ab"),
                            ("engine_tokens", "engine_tokens_ab")):
            if mine in runs and other in runs:
                print(f"{mine}: {runs[mine][0]['code']}; {other}: {runs[other][0]['code']}")
        oa = child("openai", port, min(args.n, 2000), args.concurrency) if args.openai else None
    # The engine tunes the garbage collector (core/generate/api/limits.py tune_gc); the bare_gc row gives the bare
    # loop the same settings, so the engine's own overhead shows as engine / that row.
    finally:
        sim.terminate()
        sim.wait()
        ab_tmp.cleanup()
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("rate", "rss_mb", "cpu_us")} for m in order}
    # Ratios per round (the two rows of a round ran back to back), then their median.
    cpu_ratio = {m: statistics.median(b["cpu_us"] / x["cpu_us"] for b, x in zip(runs["bare"], runs[m]))
                 for m in order}
    rate_ratio = {m: statistics.median(x["rate"] / b["rate"] for b, x in zip(runs["bare"], runs[m])) for m in order}
    rows = [(names[m], med[m]["rate"], rate_ratio[m], med[m]["rss_mb"], med[m]["cpu_us"], cpu_ratio[m])
            for m in order]
    if oa is not None:
        rows.append(("AsyncOpenAI (httpx)", oa["rate"], oa["rate"] / med["bare"]["rate"], oa["rss_mb"],
                     oa["cpu_us"], med["bare"]["cpu_us"] / oa["cpu_us"]))
    nofsync = med.get("engine_nofsync")
    # The issue's measure: the engine's CPU per request over a bare loop given the same event loop and GC,
    # per round (the two rows of a round ran in the same minutes).
    tuned = ([x["cpu_us"] / t["cpu_us"] for t, x in zip(runs["bare_tuned"], runs["engine"])]
             if "bare_tuned" in runs and "engine" in runs else [])
    if {"bare_tuned", "engine", "engine_ab"} <= runs.keys():  # the other checkout's engine against the same reference
        ab = [x["cpu_us"] / t["cpu_us"] for t, x in zip(runs["bare_tuned"], runs["engine_ab"])]
        rel = [e["cpu_us"] / a["cpu_us"] for e, a in zip(runs["engine"], runs["engine_ab"])]
        print(f"engine_ab CPU per request / the tuned bare loop's, per round: {', '.join(f'{r:.2f}' for r in ab)}; "
              f"median {statistics.median(ab):.2f}x{median_interval(ab)}; engine / engine_ab per round: "
              f"{', '.join(f'{r:.2f}' for r in rel)}{median_interval(rel)}")
    per_round(runs, "engine_mt", "engine", f"engine CPU per request, {MT_TURNS}-turn conversations / single-turn")
    per_round(runs, "engine_alone", "bare_tuned", "the engine's own work per request (engine_alone) / the tuned bare "
              "loop's CPU per request (A/B of the engine's own code; the target is read on the engine row)")
    per_round(runs, "engine_alone_ab", "bare_tuned", "the same for the --ab-code checkout (engine_alone_ab)")
    per_round(runs, "engine_alone", "engine_alone_ab", "own work per request, this checkout / the --ab-code one")
    reconstruction_table(runs)
    if args.no_concurrency:
        print_table(args, rows, cpu_ratio, rate_ratio, nofsync, med, None, None, None, tuned)
        return
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

    print_table(args, rows, cpu_ratio, rate_ratio, nofsync, med, hold_s, peak, conc, tuned)


def reconstruction_table(runs: dict[str, list[dict]]) -> None:
    """Issue 51's measure of token reconstruction: the CPU per answer of the run with it on (every process:
    the main one and its token workers) over the same run's with it off, per round, with the start-up
    (tokenizer loads, worker start: once a run, whatever its size) and without; each row's wall time over
    the bare aiohttp loop's (the inverse of req/s); medians of the rounds."""
    rows = [m for m in ("engine", "engine_tokens", "engine_tokens_ab") if m in runs]
    if "engine_tokens" not in rows or "engine" not in rows:
        return

    def steady(x: dict) -> float:  # CPU per answer less the start-up's share
        return x["cpu_us"] - x.get("startup_cpu_s", 0.0) * 1e6 / x["n"]

    def main_steady(x: dict) -> float:  # the main process's, less its share of the start-up
        return x.get("main_cpu_us", x["cpu_us"]) - x.get("main_startup_s", 0.0) * 1e6 / x["n"]

    def workers_steady(x: dict) -> float:  # the workers', less theirs
        start_up = x.get("startup_cpu_s", 0.0) - x.get("main_startup_s", 0.0)
        return x.get("workers_cpu_us", 0.0) - start_up * 1e6 / x["n"]
    print("\ntoken reconstruction on vs off: CPU per answer of every process of the run (main + token workers), "
          "with the start-up and after it (main us and workers us: after it); wall time / the bare loop's; "
          "medians of the rounds\n")
    print(f"| {'run':26} | {'CPU us/answer':>13} | {'start-up CPU s':>14} | {'after start-up':>14} | {'main us':>7} | "
          f"{'workers us':>10} | {'on / off':>8} | {'after start-up / off':>20} | {'wall / bare':>11} |")
    print(f"|{'-' * 28}|{'-' * 15}|{'-' * 16}|{'-' * 16}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 22}|{'-' * 13}|")
    labels = {"engine": "reconstruct off (engine)", "engine_tokens": "reconstruct on",
              "engine_tokens_ab": "reconstruct on, --ab-code"}
    for m in rows:
        xs = runs[m]
        off = [x["cpu_us"] / e["cpu_us"] for x, e in zip(xs, runs["engine"])]
        off_steady = [steady(x) / e["cpu_us"] for x, e in zip(xs, runs["engine"])]
        wall = [b["rate"] / x["rate"] for x, b in zip(xs, runs["bare"])]
        print(f"| {labels[m]:26} | {statistics.median(x['cpu_us'] for x in xs):13.0f} | "
              f"{statistics.median(x.get('startup_cpu_s', 0.0) for x in xs):14.2f} | "
              f"{statistics.median(steady(x) for x in xs):14.0f} | "
              f"{statistics.median(main_steady(x) for x in xs):7.0f} | "
              f"{statistics.median(workers_steady(x) for x in xs):10.0f} | "
              f"{statistics.median(off):7.2f}x | {statistics.median(off_steady):19.2f}x | "
              f"{statistics.median(wall):10.2f}x |")
    for m in ("engine_tokens", "engine_tokens_ab"):
        if m in runs:
            r = [x["cpu_us"] / e["cpu_us"] for x, e in zip(runs[m], runs["engine"])]
            q = [steady(x) / e["cpu_us"] for x, e in zip(runs[m], runs["engine"])]
            print(f"{labels[m]} / off, CPU per answer, per round: {', '.join(f'{v:.2f}' for v in r)}; after "
                  f"start-up: {', '.join(f'{v:.2f}' for v in q)}; medians {statistics.median(r):.2f}x and "
                  f"{statistics.median(q):.2f}x (target <= 1.3x)", flush=True)


def median_interval(values: list[float], level: float = 0.9) -> str:
    """The median's `level` interval by bootstrap (resampled with replacement, seeded: the same rounds give
    the same interval), as text; empty under 5 rounds. One round's ratio moves by +-25% on a shared
    machine: with --rounds 15 or more, one run's interval is narrow enough to tell 1.3x from 1.4x."""
    if len(values) < 5:
        return ""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    cut = int(len(meds) * (1 - level) / 2)
    return f"; {level:.0%} interval of the median {meds[cut]:.2f}-{meds[-1 - cut]:.2f}"


def per_round(runs: dict[str, list[dict]], row: str, ref: str, what: str) -> None:
    """`row`'s CPU per request over `ref`'s, per round (the two ran in the same minutes), and their median."""
    if row in runs and ref in runs:
        r = [x["cpu_us"] / y["cpu_us"] for x, y in zip(runs[row], runs[ref])]
        print(f"{what}, per round: {', '.join(f'{v:.3f}' for v in r)}; median {statistics.median(r):.3f} "
              f"(min {min(r):.3f}, max {max(r):.3f})", flush=True)


def print_table(args: argparse.Namespace, rows: list, cpu_ratio: dict, rate_ratio: dict, nofsync: dict | None,
                med: dict, hold_s: float | None, peak: int | None, conc: dict | None,
                tuned: list[float] | None = None) -> None:
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"\nengine vs references, {args.concurrency} in flight, simulator latency 0, {args.n} requests{rounds}\n")
    print(f"| {'client':24} | {'req/s':>8} | {'vs bare':>8} | {'CPU us/req':>10} | {'CPU vs bare':>11} | "
          f"{'peak RSS MB':>11} |")
    print(f"|{'-' * 26}|{'-' * 10}|{'-' * 10}|{'-' * 12}|{'-' * 13}|{'-' * 13}|")
    for name, rate, ratio, rss, cpu_us, cratio in rows:
        print(f"| {name:24} | {rate:8.0f} | {ratio:7.2f}x | {cpu_us:10.0f} | {cratio:10.2f}x | {rss:11.0f} |")
    if "engine" in med:
        e = med["engine"]
        print(f"\nengine / bare: {rate_ratio['engine']:.2f}x req/s (target >= 0.9x); client CPU per request, bare / "
              f"engine: {cpu_ratio['engine']:.2f}x (target >= 1.1x); engine peak RSS {e['rss_mb']:.0f} MB "
              "(target <= 300 MB, no tokenizer loaded)")
        if "bare_gc" in med:
            print(f"engine / bare with the same GC settings: {e['rate'] / med['bare_gc']['rate']:.2f}x req/s, "
                  f"CPU per request {med['bare_gc']['cpu_us'] / e['cpu_us']:.2f}x")
        if tuned:
            print(f"engine CPU per request / the tuned bare loop's (same event loop and GC), per round: "
                  f"{', '.join(f'{r:.2f}' for r in tuned)}; median {statistics.median(tuned):.2f}x "
                  f"(min {min(tuned):.2f}, max {max(tuned):.2f}{median_interval(tuned)}; issue 51: target <= 1.2x)")
        if nofsync is not None:
            print(f"engine (fsyncs) / engine with fsync a no-op: {e['rate'] / nofsync['rate']:.2f}x req/s, "
                  f"CPU per request {nofsync['cpu_us'] / e['cpu_us']:.2f}x")
    if "engine_max_usd" in med:
        print(f"engine + max_usd (spend ledger and reservations, ceiling checked) / bare: "
              f"{rate_ratio['engine_max_usd']:.2f}x req/s, CPU {cpu_ratio['engine_max_usd']:.2f}x (target >= 0.9x)")
    if args.openai and "engine" in med:
        print(f"engine / AsyncOpenAI: {med['engine']['rate'] / rows[-1][1]:.1f}x (target >= 20x)")
    if conc is not None:
        print(f"concurrency reached at {hold_s:g} s latency: simulator peak {peak} / configured {args.concurrency} = "
              f"{peak / args.concurrency:.3f} (target >= 0.98); engine's own peak in flight {conc['peak_in_flight']}")


if __name__ == "__main__":
    main()
