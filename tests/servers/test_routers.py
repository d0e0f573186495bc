"""draftgen behind the routers SGLang and vLLM release (docs/routers.md): `sglang-router` 0.3.2 and
`vllm-router` 0.1.17 on loopback, one base URL in front of three simulator workers (`draftgen simulate`,
given to the router as http://127.0.0.1:PORT/api: it probes {worker}/health, then posts to
{worker}/v1/chat/completions). A real `draftgen run` (its smoke gate included) goes through the router;
every prompt is answered once, every worker served (counted at the workers), and the records are checked
as a run against one server checks them. Skipped, with the reason, where the router is not installed
(`pip install -e '.[routers]'`; Linux x86-64 wheels only).

What each router does to a request (read from what the workers received, docs/routers.md): both add
SGLang's sampling keys to the body; vllm-router keeps `return_token_ids` (the workers' ids come back)
and adds `include_reasoning: true`; sglang-router drops keys it does not know, `return_token_ids`
among them (the answers come without ids, counted as such).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from draftgen.core.rundir import RunDir
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator.stats import prompt_key
from tests.helpers import TEST_KEY, cli_env, make_config, read_ids

N = 60
WORKERS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=2) as r:
        return orjson.loads(r.read())


def _wait(what: str, ready, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 60) -> None:
    """Poll `ready()` until it is true; the process dying or the limit passing fails with its log."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}"
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready in {limit_s:.0f} s: {log.read_text(errors='replace')[-3000:]}")


class Procs:
    """The test's own subprocesses, killed by pid at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=cli_env())
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _router_args(router: str, exe: str, port: int, workers: list[str]) -> list[str]:
    """The command lines docs/routers.md gives: loopback only (sglang-router binds 0.0.0.0 and its
    metrics to 0.0.0.0:29000 unless told), round robin, a metrics port of the test's own."""
    if router == "sglang-router":
        return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                "--worker-startup-check-interval", "1"]
    # vllm-router sends its GETs to a worker (/v1/key, /version...) with its own --api-key, not the
    # client's: the workers here, like a vLLM started with --api-key, answer only a keyed request.
    return [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", "round_robin", "--prometheus-port", str(_free_port()), "--api-key", TEST_KEY,
            "--worker-startup-check-interval", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("router", ["vllm-router", "sglang-router"])
def test_a_run_through_a_router_in_front_of_three_workers(tmp_path: Path, router: str) -> None:
    exe = shutil.which(router) or shutil.which(router, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{router} is not installed: pip install -e '.[routers]' (Linux x86-64 wheels)")
    procs = Procs()
    try:
        workers = []
        for i in range(WORKERS):
            port = _free_port()
            log = tmp_path / f"worker{i}.log"
            proc = procs.start([sys.executable, "-m", "draftgen.cli.main", "simulate", "--port", str(port),
                                "--seed", "7", "--latency-scale", "0", "--mean-tokens", "60"], log)
            url = f"http://127.0.0.1:{port}/api"
            _wait(f"worker {i}", lambda u=url: urllib.request.urlopen(f"{u}/health", timeout=2).status == 200,
                  proc, log)
            workers.append(url)
        port = _free_port()
        log = tmp_path / "router.log"
        proc = procs.start(_router_args(router, exe, port, workers), log)
        router_url = f"http://127.0.0.1:{port}"

        def all_healthy() -> bool:
            listed = _get_json(f"{router_url}/workers")
            assert isinstance(listed, dict)
            return sorted(w["url"] for w in listed["workers"] if w["is_healthy"]) == sorted(workers)
        _wait(router, all_healthy, proc, log)

        # kind set: behind vllm-router GET /v1/key reaches a worker, and the simulator answers it as
        # OpenRouter would (docs/routers.md).
        config = make_config(tmp_path, f"{router_url}/v1",
                             [{"name": "a", "n": N, "concurrency": 8, "max_tokens": 1024}],
                             tables={"api": {"kind": "openai-compatible", "return_token_ids": True},
                                     "tokenizer": {"path": str(bundled_kimi_path())}},
                             request={"temperature": 0.6})
        run = subprocess.run([sys.executable, "-m", "draftgen.cli.main", "run", str(config.path), "--headless",
                              "--interval", "1"], env=cli_env(), text=True, capture_output=True, timeout=180)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

        # The start-up check passed through the router: model, stream mode, ids, tokens.
        rd = RunDir(tmp_path / "run")
        smoke = orjson.loads((rd.root / "smoke.json").read_bytes())
        rows = {r["check"]: r for r in smoke["rows"]}
        assert smoke["passed"], rows
        for check in ("key", "stream", "a: model", "a: tokens", "a: prompt tokens", "a: finish"):
            assert rows[check]["passed"], rows[check]

        # Every prompt answered once, each by one worker; every worker served.
        ids = read_ids(rd.responses("a"))
        assert sorted(ids) == sorted(f"a-{i}" for i in range(N))
        prompts = {orjson.loads(line)["id"]: orjson.loads(line)["prompt"]
                   for line in (tmp_path / "prompts" / "a.jsonl").read_bytes().splitlines()}
        answered: dict[str, int] = {}
        for url in workers:
            stats = _get_json(url.removesuffix("/api") + "/_sim/stats")
            assert isinstance(stats, dict)
            assert stats["answers_total"] > 0, f"{url} served nothing: {stats}"
            for key, n in stats["prompt_answers"].items():
                answered[key] = answered.get(key, 0) + n
        counts = sorted(answered.get(prompt_key([{"role": "user", "content": text}]), 0)
                        for text in prompts.values())
        # Each prompt answered once, except the smoke test's sample (asked again by the smoke test).
        assert counts[0] == 1 and counts[-2] == 1, counts

        # The records and ids, checked as against one server (the run's `draftgen tokens` step).
        records = [orjson.loads(line) for line in rd.responses("a").read_bytes().splitlines()]
        assert all(r["model"] == "moonshotai/kimi-k2.5" and r["finish_reason"] == "stop" for r in records)
        report = orjson.loads((rd.root / "a" / "tokens" / "report.json").read_bytes())
        assert (report["checked"], report["valid"], report["invalid"]) == (N, N, 0), report
        if router == "vllm-router":  # return_token_ids passes: the workers' ids are the samples'
            assert report["from_backend"] == N, report
            assert rows["a: tokens"]["detail"].endswith("the server's token ids equal the reconstruction")
        else:  # sglang-router drops return_token_ids: reconstructed ids, each answer counted without
            assert report["from_backend"] == 0, report
            assert f"{N} without the server's token ids" in run.stdout + run.stderr
        assert TEST_KEY not in run.stdout + run.stderr + (rd.root / "events.log").read_text()
    finally:
        procs.close()
