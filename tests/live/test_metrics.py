"""[monitor] metrics: Prometheus text on /metrics from the snapshot the panels read (core/live/metrics.py),
scraped with aiohttp and read back with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import io
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from draftgen.core.errors import ConfigError
from draftgen.core.live.metrics import registry_for
from draftgen.core.live.snapshot import ProviderStat, RunSnapshot
from draftgen.core.run.pipeline import Pipeline
from draftgen.core.rundir import RunDir
from draftgen.core.safe_text import visible
from draftgen.simulator import SimConfig, SimServer
from tests import fixtures as fx
from tests.helpers import TEST_KEY, cli_env, make_config, read_ids, until

SERVING = re.compile(r"metrics: serving (http://127\.0\.0\.1:\d+/metrics)")


def families(text: str) -> dict[str, list]:
    """{family name: its samples} as prometheus_client's parser reads the exposition."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def exposition(s: RunSnapshot) -> str:
    """What /metrics serves for snapshot `s`."""
    return generate_latest(registry_for(lambda: s)).decode()


def value(fams: dict[str, list], sample: str, **labels: str) -> float:
    """The one sample named `sample` with exactly these labels."""
    found = [s.value for samples in fams.values() for s in samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, f"{sample}{labels}: {len(found)} samples"
    return found[0]


@dataclass
class Scrape:
    answered: float
    in_flight: float
    written: int       # answer lines on disk, read after the scrape
    fams: dict[str, list]


async def _scrape_after(http: aiohttp.ClientSession, url: str, since: float, responses: Path) -> Scrape:
    """A scrape whose snapshot was taken after `since` (wall clock), then the answers on disk."""
    while True:
        async with http.get(url) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            fams = families(await r.text())
        if value(fams, "draftgen_snapshot_timestamp_seconds") > since:
            break
        await asyncio.sleep(0.05)
    return Scrape(answered=value(fams, "draftgen_requests_total", outcome="answered"),
                  in_flight=value(fams, "draftgen_in_flight_requests"), written=len(read_ids(responses)), fams=fams)


async def _frozen(sim: SimServer, answers: int) -> float:
    """Wait until the simulator has sent `answers` whole answers and refuses the rest (429, the rate_limited
    scenario): from then on no answer can reach the run. Returns the wall clock then."""
    await until(lambda: sim.stats.by_status.get("200", 0) == answers and sim.stats.by_status.get("429", 0) > 0,
                f"the simulator answered {answers} requests and refused the next")
    assert sim.stats.by_status.get("200", 0) == answers
    return time.time()


@pytest.mark.slow
async def test_a_headless_run_serves_metrics_that_follow_its_answers(tmp_path):
    """`draftgen run --headless` with [monitor] metrics on: /metrics, scraped twice while the run is live,
    parses, its request counter rises and equals the answers on disk within what was in flight."""
    first, more = 6, 7
    async with SimServer(SimConfig(seed=3, fixed_latency_s=0.02, mean_completion_tokens=40), port=0) as sim:
        # Requests 1-6 are answered, every later one gets 429 (spends no attempt): the run holds still.
        sim.scenario("rate_limited", after_requests=first, retry_after=0.2)
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 4}],
                          tables={"engine": {"reconstruct": False}, "monitor": {"metrics": "127.0.0.1:0"}})
        responses = RunDir(cfg.run_dir).responses("a")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", "--skip-smoke",
            "--interval", "0.2", env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        assert proc.stdout is not None
        out: list[str] = []
        try:
            while not (m := SERVING.search("".join(out))):
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert line, "the run ended without serving metrics: " + "".join(out)[-3000:]
                out.append(line)
            url = m.group(1)
            async with aiohttp.ClientSession() as http:
                one = await _scrape_after(http, url, await _frozen(sim, first), responses)
                assert one.answered <= one.written <= one.answered + one.in_flight, one
                # Let `more` answers through, then hold again.
                sim.scenario("rate_limited", after_requests=sim.stats.requests_total + more, retry_after=0.2)
                two = await _scrape_after(http, url, await _frozen(sim, first + more), responses)
                assert two.answered <= two.written <= two.answered + two.in_flight, two
                assert two.answered > one.answered
                # Held still, the figures settle on exactly the answers written.
                while (s := await _scrape_after(http, url, time.time(), responses)).answered != first + more:
                    await asyncio.sleep(0.05)
                assert s.written == first + more
                usage = [orjson.loads(line)["usage"] for line in responses.read_bytes().splitlines()]
                for kind in ("prompt", "completion", "reasoning"):
                    billed = sum(u[f"{kind}_tokens"] for u in usage)
                    assert billed > 0 and value(s.fams, f"draftgen_dataset_{kind}_tokens_total", dataset="a") == billed
                assert value(s.fams, "draftgen_dataset_answered_total", dataset="a") == first + more
                assert value(s.fams, "draftgen_dataset_prompts", dataset="a") == 60
                assert value(s.fams, "draftgen_concurrency_configured") == 4
                assert value(s.fams, "draftgen_errors_total", kind="429") > 0
                assert value(s.fams, "draftgen_stage_state", stage="generation", state="running") == 1
                assert value(s.fams, "draftgen_spend_dollars", scope="run") > 0
                upstream = [x for x in s.fams["draftgen_upstream_answers"] if x.name.endswith("_total")]
                assert {x.labels["upstream"] for x in upstream} <= set(sim.stats.answers_by_provider)
                assert sum(x.value for x in upstream) == first + more
            proc.send_signal(signal.SIGINT)  # drain: the prompts retrying after a 429 are given up
            rest, _ = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text = "".join(out) + rest.decode()
        assert proc.returncode == 3 and "Traceback" not in text, text[-3000:]
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectionError):  # the server went with the run
                await http.get(url)


def test_hostile_upstream_names_cannot_break_the_exposition():
    """Label values from servers (provider names, dataset and GPU names) go through as Prometheus escapes them,
    with their control characters shown as escapes: no sample or family can be injected, no terminal command."""
    hostile = ('evil"} 1\ndraftgen_requests_total{outcome="answered"} 1e9\n# TYPE x counter\nx_total 7',
               "back\\slash\\", "\x1b]0;pwned\x07title\x1b[2J", "bidi \u202eesrever", "lone \udc80 surrogate")
    s = fx.running()
    s = replace(s, provider_stats=tuple(ProviderStat(name=n, answers=i + 1, errors=i, latency_mean_s=1.5,
                                                     latency_p90_s=2.0, completion_tokens=10 * i)
                                        for i, n in enumerate(hostile)),
                datasets=(replace(s.datasets[0], name=hostile[0]),), model=hostile[2], run_name=hostile[1])
    raw = generate_latest(registry_for(lambda: s))
    assert b"\x1b" not in raw and b"\x07" not in raw and "\u202e".encode() not in raw
    fams = families(raw.decode())
    assert all(name.startswith("draftgen_") for name in fams), sorted(fams)
    assert value(fams, "draftgen_requests_total", outcome="answered") == s.datasets[0].done
    shown = [visible(n, one_line=True) for n in hostile]
    assert [x.labels["upstream"] for x in fams["draftgen_upstream_answers"]] == shown
    for i, name in enumerate(shown):
        assert value(fams, "draftgen_upstream_errors_total", upstream=name) == i
        assert value(fams, "draftgen_upstream_latency_seconds_count", upstream=name) == i + 1
        assert value(fams, "draftgen_upstream_latency_seconds", upstream=name, quantile="0.9") == 2.0
    assert value(fams, "draftgen_dataset_prompts", dataset=shown[0]) == s.datasets[0].total
    assert value(fams, "draftgen_run_info", run=shown[1], model=shown[2]) == 1


def test_gpu_figures_are_served_while_a_stage_samples_them():
    s = fx.extracting()
    assert s.gpus
    fams = families(exposition(s))
    for g in s.gpus:
        labels = {"gpu": str(g.index), "name": g.name}
        assert value(fams, "draftgen_gpu_utilization_ratio", **labels) == pytest.approx(g.util_pct / 100)
        assert value(fams, "draftgen_gpu_memory_used_bytes", **labels) == pytest.approx(g.mem_used_mb * 2**20)
    assert value(fams, "draftgen_stage_state", stage="extract", state="running") == 1


async def test_two_runs_in_one_process_serve_their_own_figures(tmp_path):
    """Each run has its own registry and server: two pipelines on one event loop do not clash."""
    pipelines = []
    try:
        for name, n in (("first", 3), ("second", 5)):
            cfg = make_config(tmp_path / name, "http://127.0.0.1:9", [{"name": name, "n": 9, "concurrency": n}],
                              tables={"monitor": {"metrics": "127.0.0.1:0"}})
            pipeline = Pipeline(cfg, TEST_KEY, reconstruct=False)
            await pipeline.start()
            pipelines.append(pipeline)
        async with aiohttp.ClientSession() as http:
            for pipeline, (name, n) in zip(pipelines, (("first", 3), ("second", 5))):
                async with http.get(pipeline._metrics.url) as r:
                    fams = families(await r.text())
                assert [x.labels["dataset"] for x in fams["draftgen_dataset_prompts"]] == [name]
                assert value(fams, "draftgen_dataset_concurrency_configured", dataset=name) == n
    finally:
        for pipeline in pipelines:
            await pipeline.close()


async def test_a_port_in_use_stops_the_run_naming_the_key_before_any_request(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with SimServer(SimConfig(seed=1, fixed_latency_s=0.01), port=0) as sim:
            cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 3}],
                              tables={"monitor": {"metrics": f"127.0.0.1:{port}"}})
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "draftgen.cli.main", "run", str(cfg.path), "--headless", env=cli_env(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            text = out.decode()
            assert proc.returncode not in (0, None), text
            assert f"monitor.metrics = \"127.0.0.1:{port}\"" in text and "Traceback" not in text, text
            assert sim.stats.requests_total == 0, "a request was sent before the metrics server was bound"


@pytest.mark.parametrize("address, public, error", [
    ("0.0.0.0:9400", False, "not a loopback address"),
    ("example.org:9400", False, "not a loopback address"),
    ("127.0.0.1", False, "must be HOST:PORT"),
    ("::1:9400", False, "in brackets"),
    ("127.0.0.1:99999", False, "from 0 to 65535"),
    ("0.0.0.0:9400", True, None),
    ("[::1]:9400", False, None),
    ("localhost:0", False, None),
])
def test_the_metrics_address_is_loopback_unless_made_public_on_purpose(tmp_path, address, public, error):
    tables = {"monitor": {"metrics": address, "metrics_public": public}}
    if error is None:
        cfg = make_config(tmp_path, "http://127.0.0.1:9", [{"name": "a", "n": 1}], tables=tables)
        assert cfg.monitor.metrics_address() is not None
        return
    with pytest.raises(ConfigError, match="monitor.metrics") as e:
        make_config(tmp_path, "http://127.0.0.1:9", [{"name": "a", "n": 1}], tables=tables)
    assert error in str(e.value)


def test_metrics_are_off_by_default(tmp_path):
    cfg = make_config(tmp_path, "http://127.0.0.1:9", [{"name": "a", "n": 1}])
    assert cfg.monitor.metrics_address() is None


def test_the_example_dashboard_and_the_docs_name_only_series_that_are_served():
    served = set()
    for s in (fx.running(), fx.extracting(), fx.paused()):
        served |= {x.name for samples in families(exposition(s)).values() for x in samples}
    root = Path(__file__).resolve().parents[2]
    dashboard = (root / "docs" / "grafana-dashboard.json").read_text()
    named = set(re.findall(r"draftgen_[a-z_]+", dashboard))
    assert named and named <= served, sorted(named - served)
    def family(name: str) -> str:
        return re.sub(r"_(total|count|sum)$", "", name.removeprefix("draftgen_"))
    documented = {family(n) for n in re.findall(r"`([a-z_]+)`", (root / "docs" / "metrics.md").read_text())}
    assert {family(n) for n in served} <= documented, sorted({family(n) for n in served} - documented)


@pytest.mark.slow
async def test_the_tui_serves_metrics_while_its_run_is_live(tmp_path):
    """The TUI embeds the same pipeline: /metrics is served while the app shows the run, gone after."""
    from draftgen.tui.app import DraftgenApp
    from draftgen.tui.launch import run_tui
    seen: dict[str, Any] = {}
    async with SimServer(SimConfig(seed=2, fixed_latency_s=0.02, mean_completion_tokens=40), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 10, "concurrency": 2}],
                          tables={"engine": {"reconstruct": False}, "monitor": {"metrics": "127.0.0.1:0"}})

        async def drive(app: DraftgenApp) -> None:
            async with app.run_test(size=(120, 40)) as pilot, aiohttp.ClientSession() as http:
                pipeline = app.controls
                assert isinstance(pipeline, Pipeline)
                await until(lambda: app.latest is not None and app.latest.finished, "the run done", timeout=60)
                seen["url"] = pipeline._metrics.url
                async with http.get(pipeline._metrics.url) as r:
                    seen["done"] = families(await r.text())
                await pilot.press("q")
                await until(lambda: not app.is_running, "the app exited", timeout=60)

        await asyncio.wait_for(run_tui(cfg, TEST_KEY, out=io.StringIO(), run_app=drive, skip_smoke=True), 120)
    fams = seen["done"]
    assert value(fams, "draftgen_requests_total", outcome="answered") == 10 == len(read_ids(
        RunDir(cfg.run_dir).responses("a")))
    assert value(fams, "draftgen_run_state", state="DONE") == 1
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(seen["url"])
