"""Prometheus text on `/metrics` while a run is live (`[monitor] metrics`, docs/metrics.md).

What is served is read from the hub's latest snapshot at scrape time (`SnapshotCollector`), the same
`RunSnapshot` the panels, the headless line and the attach stream render: nothing is counted twice
and nothing is added to the engine's hot path. Each server has its own `CollectorRegistry` (never
prometheus_client's global one), so two runs in one process serve their own figures.

The server is an aiohttp app on the run's event loop. It binds in `start()`, before the run sends
anything: an address in use is a `MetricsError` naming the config key. Text from outside (provider,
dataset and GPU names, the model) goes into label values through `visible(..., one_line=True)` (a
`curl` in a terminal shows no escape sequence of a server's) and prometheus_client escapes the
backslashes, quotes and line breaks the exposition format reserves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from draftgen.core.errors import DraftgenError
from draftgen.core.live.snapshot import (
    STAGE_NAMES,
    DatasetSnapshot,
    DatasetStatus,
    RunSnapshot,
    RunState,
    StageState,
)
from draftgen.core.safe_text import visible

PREFIX = "draftgen_"
LATENCY_QUANTILE = "0.9"  # the providers panel's p90 (core/live/recent.py, over each one's recent answers)


class MetricsError(DraftgenError):
    pass


def _label(text: str) -> str:
    """A label value from outside text: controls shown as escapes, on one line."""
    return visible(text, one_line=True)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))


def _state_set(name: str, doc: str, label: str, values: tuple[str, ...], current: str) -> GaugeMetricFamily:
    """One sample per possible value, 1 for `current` (a state set: a change shows as 0 -> 1, never as a
    series that vanishes)."""
    family = GaugeMetricFamily(PREFIX + name, doc, labels=[label])
    for value in values:
        family.add_metric([value], 1.0 if value == current else 0.0)
    return family


def run_families(s: RunSnapshot) -> Iterator[Metric]:
    """The run as a whole: what it is, its state and stages, requests, concurrency, rates."""
    info = _gauge("run_info", "The run directory's name and the model asked (always 1).", ("run", "model"))
    info.add_metric([_label(s.run_name), _label(s.model)], 1.0)
    yield info
    taken = _gauge("snapshot_timestamp_seconds", "Wall clock of the snapshot these figures were read from.")
    taken.add_metric([], s.taken_at)
    yield taken
    elapsed = _gauge("elapsed_seconds", "Seconds this run (process) has run.")
    elapsed.add_metric([], s.elapsed_s)
    yield elapsed
    yield _state_set("run_state", "The generation's state (docs/run-end.md; 1 for the current one).", "state",
                     tuple(RunState), s.state)
    stages = GaugeMetricFamily(PREFIX + "stage_state", "Each stage's state (1 for its current one); the "
                               "running stage is the one with state=\"running\".", labels=["stage", "state"])
    for stage in STAGE_NAMES:
        current = s.stage_state(stage)
        for state in StageState:
            stages.add_metric([stage, state], 1.0 if state == current else 0.0)
    yield stages
    done = _gauge("stage_done", "A one-shot stage's items done (smoke checks, answers reconstructed, samples "
                  "merged or extracted).", ("stage",))
    total = _gauge("stage_total", "A one-shot stage's items to do (0: not known yet).", ("stage",))
    for st in s.stages:
        done.add_metric([_label(st.name)], st.done)
        total.add_metric([_label(st.name)], st.total)
    yield done
    yield total

    requests = _counter("requests", "Prompts asked that ended, by outcome: answered (an answer on disk) or failed "
                        "(failed for good); this run and the earlier runs of the directory.", ("outcome",))
    requests.add_metric(["answered"], sum(d.done for d in s.datasets))
    requests.add_metric(["failed"], sum(d.failed for d in s.datasets))
    yield requests
    errors = _counter("errors", "Failed attempts (and kept answers tallied as errors: length, empty_content, ...) "
                      "by kind, this process; the errors panel's tally.", ("kind",))
    for kind, n in s.errors:
        errors.add_metric([_label(kind)], n)
    yield errors
    retries = _counter("retries", "Attempts asked again after a transient failure, this process.")
    retries.add_metric([], s.retries)
    yield retries
    t = s.throughput
    for name, doc, value in (
            ("in_flight_requests", "Requests sent and not answered yet.", t.in_flight),
            ("concurrency_limit", "The adaptive concurrency limit now (after 429 back-off).", t.effective_concurrency),
            ("concurrency_configured", "The concurrency configured ([[datasets]] concurrency).",
             t.configured_concurrency),
            ("answers_per_second", f"Answers per second over the last {t.window_s:g} s.", t.req_s_window),
            ("completion_tokens_per_second", f"Completion tokens per second over the last {t.window_s:g} s.",
             t.tok_s_window),
            ("held_answers", "Paid answers held in memory because the disk refused them.", s.held_answers)):
        g = _gauge(name, doc)
        g.add_metric([], value)
        yield g
    if t.eta_s is not None:
        eta = _gauge("eta_seconds", "Seconds to the end of generation at the recent rate.")
        eta.add_metric([], t.eta_s)
        yield eta


def dataset_families(s: RunSnapshot) -> Iterator[Metric]:
    """Per dataset, as the datasets panel shows them."""
    families: list[tuple[GaugeMetricFamily | CounterMetricFamily, Callable[[DatasetSnapshot], float]]] = [
        (_gauge("dataset_prompts", "Usable prompts of the dataset (turns of a multi-turn one).", ("dataset",)),
         lambda d: d.total),
        (_counter("dataset_answered", "Prompts answered, on disk (this run and earlier ones).", ("dataset",)),
         lambda d: d.done),
        (_counter("dataset_failed", "Prompts failed for good, on disk.", ("dataset",)), lambda d: d.failed),
        (_gauge("dataset_skipped", "Prompts not admitted because a budget ran out (eligible for a later run).",
                ("dataset",)), lambda d: d.skipped),
        (_gauge("dataset_in_flight_requests", "The dataset's requests in flight.", ("dataset",)),
         lambda d: d.in_flight),
        (_gauge("dataset_concurrency_limit", "The dataset's adaptive concurrency limit now.", ("dataset",)),
         lambda d: d.effective_concurrency),
        (_gauge("dataset_concurrency_configured", "The dataset's configured concurrency.", ("dataset",)),
         lambda d: d.concurrency),
        (_counter("dataset_completion_tokens", "Completion tokens of the dataset's answers (reasoning included).",
                  ("dataset",)), lambda d: d.tokens_used),
        (_counter("dataset_reasoning_tokens", "Of the completion tokens, the reasoning's (as the usage says).",
                  ("dataset",)), lambda d: d.reasoning_tokens),
        (_counter("dataset_prompt_tokens", "Prompt tokens of the dataset's answers, as billed.", ("dataset",)),
         lambda d: d.prompt_tokens),
        (_gauge("dataset_cost_dollars", "What the dataset's answers cost (USD).", ("dataset",)),
         lambda d: d.cost_usd),
    ]
    for family, figure in families:
        for d in s.datasets:
            family.add_metric([_label(d.name)], figure(d))
        yield family
    status = GaugeMetricFamily(PREFIX + "dataset_status", "Each dataset's status (1 for its current one).",
                               labels=["dataset", "status"])
    for d in s.datasets:
        for value in DatasetStatus:
            status.add_metric([_label(d.name), value], 1.0 if value == d.status else 0.0)
    yield status


def money_families(s: RunSnapshot) -> Iterator[Metric]:
    """Spend, reservations, balance and projection, as the credits panel shows them (USD)."""
    c = s.credits
    spend = _gauge("spend_dollars", "Spent: scope=run this process's known costs; scope=ledger the spend "
                   "ledger over every run of the directory, pending attempts at their worst case.", ("scope",))
    spend.add_metric(["run"], c.spent_usd)
    spend.add_metric(["ledger"], c.spent_total_usd)
    yield spend
    for name, doc, value in (
            ("in_flight_dollars", "Reserved: the worst-case cost of the requests in flight.", c.in_flight_usd),
            ("pending_dollars", "Of the ledger's spend: abandoned attempts not priced yet (worst case).",
             c.pending_usd),
            ("balance_dollars", f"The account's balance: the last one fetched ({c.balance_source}) minus spend since.",
             c.balance_usd),
            ("balance_age_seconds", "Seconds since the balance was fetched.", c.balance_age_s),
            ("projected_total_dollars", "Spent plus the estimate to finish every dataset (at most max_usd).",
             c.projected_total_usd),
            ("max_dollars", "[budget] max_usd.", c.max_usd)):
        if value is None:
            continue  # not known (no balance read, no projection yet, no ceiling set): no sample, not a 0
        g = _gauge(name, doc)
        g.add_metric([], value)
        yield g


def upstream_families(s: RunSnapshot) -> Iterator[Metric]:
    """Per upstream (an OpenRouter provider, or the self-hosted server), as the providers panel shows them."""
    answers = _counter("upstream_answers", "Answers per upstream (provider or server).", ("upstream",))
    errors = _counter("upstream_errors", "Failed attempts the upstream was named in.", ("upstream",))
    tokens = _counter("upstream_completion_tokens", "Completion tokens of the upstream's answers.", ("upstream",))
    latency = SummaryMetricFamily(PREFIX + "upstream_latency_seconds", "Seconds from send to answer: _count "
                                  "answers, _sum their latencies, quantile 0.9 over the upstream's recent 256 "
                                  "answers.", labels=["upstream"])
    up = _gauge("upstream_up", "A fleet's server ([api] base_url a list): 1 in the fleet, 0 taken out.", ("upstream",))
    limit = _gauge("upstream_limit", "A fleet's server: its own adaptive limit now (cut by its 429 storms, grows "
                   "back to the run's concurrency shared evenly).", ("upstream",))
    for p in s.provider_stats:
        name = [_label(p.name)]
        if p.server:
            up.add_metric(name, 0 if p.out else 1)
            limit.add_metric(name, p.limit)
        answers.add_metric(name, p.answers)
        errors.add_metric(name, p.errors)
        tokens.add_metric(name, p.completion_tokens)
        if p.answers:
            latency.add_metric(name, count_value=p.answers, sum_value=p.latency_mean_s * p.answers)
            latency.add_sample(latency.name, {"upstream": name[0], "quantile": LATENCY_QUANTILE}, p.latency_p90_s)
    yield from (answers, errors, tokens, latency, up, limit)


def gpu_families(s: RunSnapshot) -> Iterator[Metric]:
    """Per GPU, while a stage samples them (extraction): the GPU panel's figures."""
    if not s.gpus:
        return
    labels = ("gpu", "name")
    util = _gauge("gpu_utilization_ratio", "The GPU's utilisation (NVML), 0 to 1.", labels)
    used = _gauge("gpu_memory_used_bytes", "GPU memory in use.", labels)
    total = _gauge("gpu_memory_total_bytes", "GPU memory in all.", labels)
    power = _gauge("gpu_power_watts", "The GPU's power draw.", labels)
    temp = _gauge("gpu_temperature_celsius", "The GPU's temperature.", labels)
    for g in s.gpus:
        if g.error is not None:
            continue  # its query failed: no figure is better than a made-up 0
        key = [str(g.index), _label(g.name)]
        util.add_metric(key, g.util_pct / 100.0)
        used.add_metric(key, g.mem_used_mb * 1024 * 1024)
        total.add_metric(key, g.mem_total_mb * 1024 * 1024)
        if g.power_w is not None:
            power.add_metric(key, g.power_w)
        if g.temp_c is not None:
            temp.add_metric(key, g.temp_c)
    yield from (util, used, total, power, temp)


class SnapshotCollector(Collector):
    """Every family from the latest snapshot of `latest()` at scrape time (none before the first)."""

    def __init__(self, latest: Callable[[], RunSnapshot | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        s = self._latest()
        if s is None:
            return
        for families in (run_families, dataset_families, money_families, upstream_families, gpu_families):
            yield from families(s)


def registry_for(latest: Callable[[], RunSnapshot | None]) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding one SnapshotCollector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(latest))
    return registry


class MetricsServer:
    """GET /metrics on `host:port`, from the hub's latest snapshot, on the event loop it is started on."""

    def __init__(self, latest: Callable[[], RunSnapshot | None], host: str, port: int, *, where: str,
                 key: str = "monitor.metrics") -> None:
        self.host = host
        self.port = port
        self.where = where                   # the config file, named in an error beside the key
        self.key = key
        self.registry = registry_for(latest)
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        """HOST:PORT as the config writes it ("[::1]:9400" for IPv6)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        # A scrape under way when the run ends delays its exit by at most a second, not aiohttp's 60.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            # "Address already in use" (asyncio's own message repeats the address); a name's lookup says its own.
            why = os.strerror(e.errno) if isinstance(e.errno, int) and e.errno > 0 else (e.strerror or str(e))
            raise MetricsError(f"{self.where}: {self.key} = \"{self.address}\": cannot serve metrics there ({why}): "
                               f"another process holds the port, or the address is not this machine's; set "
                               f"{self.key} to a free port (port 0 takes any)") from None
        self._runner = runner
        if self.port == 0:  # the port taken (its address too: "localhost" may have bound two, one port each)
            self.host, self.port = runner.addresses[0][:2]

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
