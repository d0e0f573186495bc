"""A fleet of self-hosted servers behind one run ([api] base_url a list, core/generate/api/fleet.py): three
`draftgen simulate` processes as openai-compatible workers, one killed by pid a third of the way through."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from draftgen.core.config_values import toml_value
from draftgen.core.errors import ConfigError
from draftgen.core.generate.api.client import RequestFailed
from draftgen.core.generate.api.fleet import FleetClient, server_name
from draftgen.core.generate.commands.smoke import run_smoke
from draftgen.core.generate.loop.concurrency import AdaptiveConcurrency
from draftgen.core.live import snapshot as snap
from draftgen.core.live.metrics import registry_for
from draftgen.core.live.recent import ProviderStats
from draftgen.core.live.snapshot import RunSnapshot
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.tokens.fidelity import Agreement, flag_providers
from draftgen.core.tokens.tokenizer import bundled_kimi_path
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, cli_env, make_config, until, write_prompts


def limits(configured: int, said: Any) -> AdaptiveConcurrency:
    """A server's adaptive limit, as the engine makes it."""
    return AdaptiveConcurrency(configured, on_change=said)


def _simulator(latency: float) -> tuple[subprocess.Popen[str], str]:
    """A `draftgen simulate` process on a free port, and its base URL (from its first line)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRAFTGEN_SIM_KEY": TEST_KEY}
    proc = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "simulate", "--port", "0",
                             "--fixed-latency", str(latency), "--mean-tokens", "40", "--status-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "http://127.0.0.1:" in first, first
    return proc, first.split(" at ")[1].strip()


def _config(tmp_path: Path, urls: list[str], n: int, concurrency: int) -> Path:
    write_prompts(tmp_path / "prompts" / "a.jsonl", n, prefix="a-")
    lines = ["[api]", f"base_url = {toml_value(urls)}", 'kind = "openai-compatible"', 'api_key_env = "DG_TEST_KEY"',
             'model = "moonshotai/kimi-k2.5"', "request_timeout_s = 30", "connect_timeout_s = 5", "",
             "[tokenizer]", f"path = {toml_value(str(bundled_kimi_path()))}", "",
             "[engine]", "backoff_base_s = 0.05", "backoff_max_s = 0.5", "", "[output]", 'dir = "run"', "",
             "[[datasets]]", 'name = "a"', 'prompts = "prompts/a.jsonl"', f"concurrency = {concurrency}",
             "max_tokens = 256"]
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _records(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_nothing_and_the_two_left_answer_the_rest(tmp_path: Path) -> None:
    sims = [_simulator(1.0) for _ in range(3)]  # >= 5 s of answers: the kill lands mid-run
    procs, urls = [p for p, _ in sims], [u for _, u in sims]
    n = 1500
    path = _config(tmp_path, urls, n, concurrency=300)
    responses = RunDir(tmp_path / "run").responses("a")
    run = subprocess.Popen([sys.executable, "-m", "draftgen.cli.main", "run", str(path), "--headless",
                            "--skip-smoke", "--interval", "1"], env=cli_env(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while (responses.read_bytes().count(b"\n") if responses.exists() else 0) < n // 3:  # a third of the way
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)  # by pid
        procs[1].wait()
        killed_at = time.time()  # the records' ts: seconds
        out, err = run.communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    records = _records(responses)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(f"a-{i}" for i in range(n))  # every prompt answered, and once
    names = [server_name(u) for u in urls]
    before = {r["server"] for r in records if r["ts"] < killed_at}
    after = [r["server"] for r in records if r["ts"] > killed_at]
    assert before == set(names), before
    # After the kill the two left answer the rest; the killed one only what it had sent whole before it.
    assert after.count(names[0]) > n // 4 and after.count(names[2]) > n // 4, (len(after), set(after))
    assert after.count(names[1]) <= 300, after.count(names[1])
    # What was in flight on it was asked again: those answers count their attempts.
    assert sum(r["attempts"] > 1 for r in records) >= 1
    # Fidelity is tallied per server: the reconstruction's index names the server of each answer.
    index = [orjson.loads(line) for line in (tmp_path / "run" / "a" / "tokens" / "index.jsonl").read_bytes()
             .splitlines()]
    assert {e["provider"] for e in index} == set(names) and len(index) == n
    # Said once in events.log, and in the summary with each server's tallies.
    events = (tmp_path / "run" / "events.log").read_text()
    assert events.count(f"server {names[1]} taken out of the fleet") == 1, events[-3000:]
    summary = out[out.rindex("draftgen: run"):]
    for name in names:
        assert f"server {name}: " in summary, summary
    assert f"server {names[1]}: " in summary and "out: " in summary.split(f"server {names[1]}: ")[1].split("\n")[0]
    assert TEST_KEY not in out + err + events


def test_a_list_of_urls_is_refused_for_openrouter_and_one_url_stays_one(tmp_path: Path) -> None:
    one = make_config(tmp_path, "http://127.0.0.1:9/v1", [{"name": "a", "n": 1}])
    assert one.api.servers == () and one.api.fleet == ("http://127.0.0.1:9/v1",)
    assert one.public_dict()["api"]["base_url"] == "http://127.0.0.1:9/v1"
    two = make_config(tmp_path, ["http://127.0.0.1:9/v1", "http://user:pw@127.0.0.1:10/v1/"],  # type: ignore[arg-type]
                      [{"name": "a", "n": 1}])
    assert two.api.base_url == "http://127.0.0.1:9/v1"
    assert two.api.servers == ("http://127.0.0.1:9/v1", "http://user:pw@127.0.0.1:10/v1")
    assert two.public_dict()["api"]["base_url"] == list(two.api.servers)
    assert server_name(two.api.servers[1]) == "http://127.0.0.1:10/v1"
    assert two.fingerprint(two.datasets[0]) != one.fingerprint(one.datasets[0])
    with pytest.raises(ConfigError, match=r"api.base_url\[1\] = 'https://openrouter.ai/api/v1'.*OpenRouter is one"):
        make_config(tmp_path, ["http://127.0.0.1:9/v1", "https://openrouter.ai/api/v1"],  # type: ignore[arg-type]
                    [{"name": "a", "n": 1}])
    with pytest.raises(ConfigError, match=r"api.base_url\[0\].*OpenRouter is one"):
        make_config(tmp_path, ["http://127.0.0.1:9/v1"], [{"name": "a", "n": 1}],  # type: ignore[arg-type]
                    tables={"api": {"kind": "openrouter"}})
    with pytest.raises(ConfigError, match=r"api.base_url\[1\] = 'http://127.0.0.1:9/v1/' is listed twice"):
        make_config(tmp_path, ["http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/"],  # type: ignore[arg-type]
                    [{"name": "a", "n": 1}])


async def test_the_smoke_test_asks_every_server_and_refuses_one_that_answers_otherwise(tmp_path: Path) -> None:
    """The second server renders another prompt (a system turn of its own: another chat template): its row
    fails naming it; the third answers as the first and passes. Each server's request is on the ledger."""
    fast: dict[str, Any] = dict(seed=3, fixed_latency_s=0.03, mean_completion_tokens=40)
    async with SimServer(SimConfig(**fast), port=0) as one, \
            SimServer(SimConfig(**fast, default_system="You are another assistant."), port=0) as two, \
            SimServer(SimConfig(**fast), port=0) as three:
        urls = [one.base_url, two.base_url, three.base_url]
        config = make_config(tmp_path, urls, [{"name": "a", "n": 3, "max_tokens": 64}],  # type: ignore[arg-type]
                             tables={"api": {"kind": "openai-compatible"},
                                     "tokenizer": {"path": str(bundled_kimi_path())}})
        result = await run_smoke(config, TEST_KEY)
        asked = [sim.stats.requests_total for sim in (one, two, three)]
    assert min(asked) >= 1, asked
    rows = {r.check: r for r in result.rows}
    bad, good = rows[f"server {server_name(urls[1])}"], rows[f"server {server_name(urls[2])}"]
    assert not bad.passed and "refused: answers otherwise than" in bad.detail and "chat template" in bad.detail, bad
    assert good.passed and f"answers as {server_name(urls[0])}" in good.detail, good
    assert not result.passed
    # Every request any server received went on the ledger before it left.
    sent = [line for line in RunDir(config.run_dir).spend.read_bytes().splitlines() if b'"e":"sent"' in line]
    assert len(sent) == sum(asked), (len(sent), asked)


def up(fleet: FleetClient, family: str = "draftgen_upstream_up") -> dict[str, float]:
    """/metrics' upstream_up (or another per-upstream family) per server, from a snapshot whose per-upstream
    stats read the fleet (as a run's do)."""
    stats = ProviderStats()
    stats.servers, stats.server_limits = fleet.servers, fleet.limits
    raw = generate_latest(registry_for(lambda: RunSnapshot("run", "m", provider_stats=stats.stats()))).decode()
    [fam] = [f for f in text_string_to_metric_families(raw) if f.name == family]
    return {x.labels["upstream"]: x.value for x in fam.samples}


async def test_a_server_that_refuses_connections_is_taken_out_probed_and_back() -> None:
    """Two simulators behind a FleetClient: requests spread over both; one closed, the next request that
    meets its refusal goes to the other in the same call (nothing sent twice), it is said out once; started
    again on the same port, GET /models brings it back, said once, and it is asked again."""
    said: list[tuple[bool, str]] = []
    config = SimConfig(seed=3, fixed_latency_s=0.03, mean_completion_tokens=40)
    async with SimServer(config, port=0) as one:
        two = SimServer(config, port=0)
        await two.start()
        port = two.port
        fleet = FleetClient((one.base_url, two.base_url), TEST_KEY, concurrency=8, probe_s=0.05, limits=limits,
                            say=lambda out, text: said.append((out, text)))
        fleet.open()
        try:
            body = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 32}
            first = await asyncio.gather(*(fleet.chat(body) for _ in range(4)))
            assert {a.server for a in first} == {server_name(one.base_url), server_name(two.base_url)}
            await two.close()
            before = one.stats.requests_total
            after = await asyncio.gather(*(fleet.chat(body) for _ in range(4)))
            assert {a.server for a in after} == {server_name(one.base_url)}
            assert one.stats.requests_total == before + 4  # each asked once: the refused one was not sent
            assert [out for out, _ in said] == [True] and server_name(two.base_url) in said[0][1], said
            assert dict(fleet.servers())[server_name(two.base_url)].startswith("cannot connect")
            assert up(fleet) == {server_name(one.base_url): 1, server_name(two.base_url): 0}
            # Each server's own limit: the concurrency of 8 shared evenly, not cut by a refusal.
            assert up(fleet, "draftgen_upstream_limit") == {server_name(one.base_url): 4, server_name(two.base_url): 4}
            two = SimServer(config, port=port)
            await two.start()
            await until(lambda: len(said) == 2, "the server back after GET /models")
            assert said[1][0] is False and "back in the fleet" in said[1][1], said
            again = await asyncio.gather(*(fleet.chat(body) for _ in range(4)))
            assert server_name(two.base_url) in {a.server for a in again}
            assert dict(fleet.servers()) == {server_name(one.base_url): "", server_name(two.base_url): ""}
            assert up(fleet) == {server_name(one.base_url): 1, server_name(two.base_url): 1}
        finally:
            await fleet.close()
            await two.close()


async def test_a_servers_429s_leave_the_datasets_limit_alone_until_every_server_storms() -> None:
    """Two simulators answering every request with a 429: while only one server is in a storm of its own,
    its failures are `fleet_limited` (its limit took them: the dataset's is not cut); once both are, they
    are not (the fleet as a whole is overloaded: the dataset's limit is cut as with one URL)."""
    config = SimConfig(seed=3, fixed_latency_s=0.0, mean_completion_tokens=40, faults={"429": 1.0})
    async with SimServer(config, port=0) as one, SimServer(config, port=0) as two:
        fleet = FleetClient((one.base_url, two.base_url), TEST_KEY, concurrency=8, limits=limits)
        fleet.open()
        body = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}

        async def ask() -> RequestFailed:
            with pytest.raises(RequestFailed) as e:
                await fleet.chat(body)
            return e.value
        try:
            first = await asyncio.gather(*(ask() for _ in range(8)))  # 4 each: no storm yet (5 make one)
            assert [e.fleet_limited for e in first] == [True] * 8
            assert {e.server for e in first} == {server_name(one.base_url), server_name(two.base_url)}
            await asyncio.gather(*(ask() for _ in range(8)))  # each its 5th to 8th: a storm each, cut
            assert fleet.limits() == {server_name(one.base_url): (2, 4), server_name(two.base_url): (2, 4)}
            third = await asyncio.gather(*(ask() for _ in range(8)))
            assert [e.fleet_limited for e in third] == [False] * 8  # both in a storm: the dataset's limit hears it
        finally:
            await fleet.close()

def test_a_server_whose_counts_depart_from_the_others_is_flagged_with_the_fleets_fix() -> None:
    """Servers are compared with each other as providers are; the fix is the fleet's (its base_url entry, or
    the same model, template and tokenizer), not a routing line that no server reads."""
    good, off = Agreement(), Agreement()
    for i in range(40):
        good.add(0, 10, 0)
        off.add(2 if i % 2 else 0, 10, 0)
    a, b, c = "http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"
    [flag] = flag_providers({a: good, b: off, c: good})
    assert flag.provider == b and not flag.ignore_line and "[api] base_url" in flag.fix, flag
    assert "template or tokenizer on this server" in flag.reason and b in flag.exclude_line
    [named] = flag_providers({"Together": good, "Novita": off, "Parasail": good})
    assert named.ignore_line == 'ignore = ["novita"]' and not named.fix  # providers: as before


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_servers_429_storm_cuts_its_own_limit_only_and_the_others_take_the_run(tmp_path: Path) -> None:
    """Three simulators behind one run at concurrency 60 (20 a server); the first answers every request with
    a 429 for a while: its own limit is cut, the others' and the dataset's are not (with one limit for the
    run, the dataset's was cut and the two others slowed with it), the other two answer the run, the
    storm's start and end and the limit back are said once each naming that server; every prompt is
    answered once, none fails. Each point is a state waited for. While it storms it gets probes only (one
    every 0.5 s) and the others carry the run: from the storm's start to the others' 200 more answers each,
    17 attempts at it against 1,276 answers by the others (before, when a server with room got requests
    however it answered: 1,476 attempts, all 429s, against 589 answers)."""
    fast = dict(seed=5, fixed_latency_s=0.1, mean_completion_tokens=40, retry_after_s=0.3)
    n, configured = 3000, 60
    async with SimServer(SimConfig(**fast), port=0) as one, SimServer(SimConfig(**fast), port=0) as two, \
            SimServer(SimConfig(**fast), port=0) as three:
        sims = (one, two, three)
        names = [server_name(s.base_url) for s in sims]
        config = make_config(tmp_path, [s.base_url for s in sims], [{"name": "a", "n": n, "concurrency": configured}],
                             tables={"api": {"kind": "openai-compatible", "request_timeout_s": 10},
                                     "engine": {"max_attempts": 80},
                                     "tokenizer": {"path": str(bundled_kimi_path()), "template": "kimi-k2.5"}})
        pipeline = Pipeline(config, TEST_KEY, skip_smoke=True, serve_attach=False, seed=1)
        await pipeline.start()
        task = asyncio.create_task(pipeline.generate())

        def server(name: str) -> snap.ProviderStat:
            return next(p for p in pipeline.snapshot().provider_stats if p.name == name)

        try:
            await until(lambda: all(s.stats.answers_total >= 30 for s in sims), "all three to answer", 60)
            assert [server(x).limit for x in names] == [20, 20, 20]
            one.update(faults={"429": 1.0})
            sent_at_storm = one.stats.requests_total
            carried_at_storm = [s.stats.answers_total for s in sims[1:]]
            await until(lambda: server(names[0]).limit <= 10, "the first server's limit cut to half", 60)
            # The others are not cut, nor the dataset's: the run keeps its 60 in flight on them.
            at_cut = [s.stats.answers_total for s in sims]
            await until(lambda: all(s.stats.answers_total >= a + 200 for s, a in zip(sims[1:], at_cut[1:])),
                        "the other two to answer 200 more each", 60)
            assert [server(x).limit for x in names[1:]] == [20, 20]
            assert pipeline.snapshot().datasets[0].effective_concurrency == configured
            assert one.stats.answers_total == at_cut[0]  # every request it got was rate-limited
            # A storming server gets probes only: the others carry the run (see the docstring for the figures).
            bounced = one.stats.requests_total - sent_at_storm
            carried = sum(s.stats.answers_total - a for s, a in zip(sims[1:], carried_at_storm))
            assert bounced * 10 <= carried, (bounced, carried)
            # Over: slow answers so the run lasts while its limit grows back (5 s quiet, then +1 a second; its
            # probes kept the storm going, so it may be cut down to 1).
            for s in sims:
                s.update(faults={}, fixed_latency_s=2.0)
            await until(lambda: server(names[0]).limit == 20, "the first server's limit back at 20", 90)
            for s in sims:
                s.update(fixed_latency_s=0.0)
            state = await asyncio.wait_for(task, 120)
        finally:
            if not task.done():
                pipeline.quit(drain=False)
            await pipeline.close()
    assert state == snap.RunState.DONE
    records = _records(RunDir(config.run_dir).responses("a"))
    assert sorted(r["id"] for r in records) == sorted(f"a-{i}" for i in range(n))  # every prompt, once
    assert not _records(RunDir(config.run_dir).failures("a"))
    log = RunDir(config.run_dir).events_log.read_text()
    said = [line for line in log.splitlines() if "storm" in line or "limit back" in line]
    assert sum(f"server {names[0]}: 429 storm: " in line for line in said) == 1, said
    assert sum(f"server {names[0]}: 429 storm over after" in line for line in said) == 1, said
    assert sum(f"server {names[0]}: limit back at the configured 20" in line for line in said) == 1, said
    assert not any(names[1] in line or names[2] in line or "a: 429 storm" in line for line in said), said
