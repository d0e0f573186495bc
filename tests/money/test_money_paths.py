"""Who pays for each request, and is it on the ledger: the smoke test's requests, answers that carry
no cost, an HTTP 408/5xx that carries a generation id, and a request that never left (TLS). Each is
checked against what the simulator billed, not against what the engine thinks it spent."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest

from draftgen.core.generate.api.answer import ChatAnswer
from draftgen.core.generate.api.classify import RequestFailed
from draftgen.core.generate.api.prices import Prices
from draftgen.core.generate.commands.smoke import SMOKE, run_smoke
from draftgen.core.generate.loop.engine import Engine
from draftgen.core.generate.money.billing import (
    as_booked,
    book_answer,
    book_answered,
    book_failure,
    look_up,
    over_reservation,
)
from draftgen.core.generate.money.reconcile import reconcile
from draftgen.core.generate.money.spend import SpendLedger
from draftgen.core.records import ErrorKind, Usage
from draftgen.core.rundir import RunDir
from draftgen.simulator import SimConfig, SimServer
from tests.helpers import TEST_KEY, dataset_row, make_config, until


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY", TEST_KEY)


def _tokenizer():
    from draftgen.core.tokens.tokenizer import bundled_kimi_path
    return bundled_kimi_path()


def _one_dataset(tmp_path, sim: SimServer, n: int):
    return make_config(tmp_path, sim.base_url, [{"name": "a", "n": n, "concurrency": 4, "max_tokens": 400}],
                       tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(_tokenizer())},
                               "engine": {"reconstruct": False}})


@contextlib.asynccontextmanager
async def _pipeline(cfg):
    from draftgen.core.run.pipeline import Pipeline
    pipe = Pipeline(cfg, TEST_KEY, skip_smoke=True, serve_attach=False)
    await pipe.start()
    try:
        yield pipe
    finally:
        await pipe.close()


def _lines(rd: RunDir) -> list[dict]:
    return [orjson.loads(x) for x in rd.spend.read_bytes().splitlines()]


# -- the smoke test's requests ------------------------------------------------------------------


async def test_smoke_requests_are_on_the_ledger_and_under_max_usd(tmp_path):
    sim_cfg = SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=60)
    async with SimServer(sim_cfg, port=0) as sim:
        datasets = [{"name": "a", "n": 20, "max_tokens": 800}, {"name": "b", "n": 10, "max_tokens": 400}]
        cfg = make_config(tmp_path, sim.base_url, datasets,
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(_tokenizer())}})
        rd = RunDir(cfg.run_dir)
        # A directory from before the spend ledger: answers on disk, no spend.jsonl.
        old = Engine(cfg, TEST_KEY, seed=1)
        await old.run()
        # The old answers' cost as on disk (each answer's usage.cost, what the engine summed).
        old_cost = sum(orjson.loads(x)["usage"]["cost"] for name in ("a", "b")
                       for x in rd.responses(name).read_bytes().splitlines())
        assert old_cost > 0
        rd.spend.unlink()
        billed_before = sim.stats.billed_usd

        result = await run_smoke(cfg, TEST_KEY)
        assert result.passed, result.summary()
        smoke_billed = sim.stats.billed_usd - billed_before
        spend = SpendLedger.read(rd.spend)
        # Two request shapes (two max_tokens): two smoke requests, each on the ledger at what it was billed.
        smoke_lines = [x for x in _lines(rd) if x.get("ds") == SMOKE]
        assert len(smoke_lines) == 2 and all(x["w"] > 0 for x in smoke_lines)
        assert spend.by_dataset[SMOKE] == pytest.approx(smoke_billed, abs=1e-9)
        # The smoke test opened the directory's ledger first: the old answers' cost carried in, and the
        # key's usage recorded as the baseline, as a run's first opening does.
        assert spend.carried_usd == pytest.approx(old_cost, abs=1e-9)
        assert spend.key_baseline is not None

        # The run after it carries nothing twice; its ledger is the old answers plus everything billed.
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "max_tokens": 800}, datasets[1]],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(_tokenizer())}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        assert dataset_row(engine, "a").done == 40
        r = (await reconcile(cfg, TEST_KEY)).reconciliation
        assert r.carried_usd == pytest.approx(old_cost, abs=1e-9)
        assert r.pending == r.unknown == 0
        assert r.total_usd == pytest.approx(old_cost + sim.stats.billed_usd - billed_before, abs=1e-4)

        # max_usd with no room left for a smoke request: it is not sent, and the row says why.
        requests = sim.stats.requests_total
        tight = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "max_tokens": 800}, datasets[1]],
                            tables={"budget": {"max_usd": round(r.total_usd + 1e-5, 6)},
                                    "tokenizer": {"path": str(_tokenizer())}})
        result = await run_smoke(tight, TEST_KEY)
    assert not result.passed and "not sent: max_usd" in result.summary()
    assert sim.stats.requests_total == requests
    assert SpendLedger.read(rd.spend).reconcile().total_usd == pytest.approx(r.total_usd, abs=1e-12)


@pytest.mark.slow
async def test_a_smoke_test_beside_a_running_engine_books_on_its_ledger(tmp_path):
    """Pressing s while a run is open: the smoke requests go on the run's own ledger, under its
    reservations, so the ceiling sees them at once."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=0.3, mean_completion_tokens=80), port=0) as sim:
        cfg = _one_dataset(tmp_path, sim, 100)
        async with _pipeline(cfg) as pipe:
            task = asyncio.create_task(pipe.generate())
            for _ in range(1500):
                if pipe.engine.spend.is_open and dataset_row(pipe.engine, "a").done:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"the run never answered: {pipe.engine.alert or pipe.error}")
            assert await pipe.smoke()
            assert pipe.engine.spend.by_dataset.get(SMOKE, 0) > 0  # on the open ledger, in memory
            await asyncio.wait_for(task, 60)
        r = (await reconcile(cfg, TEST_KEY)).reconciliation
        billed = sim.stats.billed_usd
    assert r.total_usd == pytest.approx(billed, abs=1e-4) and r.pending == r.unknown == 0
    assert sum(1 for x in _lines(RunDir(cfg.run_dir)) if x.get("ds") == SMOKE and x["e"] == "sent") == 1


@pytest.mark.slow
async def test_a_run_started_during_a_smoke_test_waits_for_its_ledger(tmp_path):
    """s pressed before the run opened its ledger: the smoke test has the ledger (locked), so the run
    waits for it instead of failing on the lock, then books on the same file."""
    async with SimServer(SimConfig(seed=4, fixed_latency_s=1.0, mean_completion_tokens=80), port=0) as sim:
        cfg = _one_dataset(tmp_path, sim, 10)
        async with _pipeline(cfg) as pipe:
            pipe.run_smoke()
            for _ in range(500):  # the smoke test has the ledger open
                if sim.stats.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert await asyncio.wait_for(pipe.generate(), 60) == "DONE", pipe.engine.alert
        billed = sim.stats.billed_usd
    assert pipe.error is None and dataset_row(pipe.engine, "a").done == 10
    r = SpendLedger.read(RunDir(cfg.run_dir).spend).reconcile()
    assert r.answered == 11 and r.total_usd == pytest.approx(billed, abs=1e-4)


# -- answers without usage.cost ------------------------------------------------------------------


@pytest.mark.parametrize("stream, misbehave", [(True, "no_usage_chunk"), (True, "no_cost"), (False, "no_cost")])
async def test_an_answer_without_a_cost_is_priced_from_its_generation_record(tmp_path, stream, misbehave):
    """A stream closed after its finish_reason chunk and before the usage chunk, or any answer without
    usage.cost, was billed all the same: the ledger prices it from the record, never at $0."""
    sim_cfg = SimConfig(seed=5, latency_scale=0.02, mean_completion_tokens=200, misbehave=(misbehave,))
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 40, "concurrency": 8, "max_tokens": 600}],
                          tables={"budget": {"max_usd": 5.0}, "api": {"stream": stream, "generation_lookup_s": 5},
                                  "engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        billed = sim.stats.billed_usd
    assert dataset_row(engine, "a").done == 40 and billed > 0
    r = engine.spend.reconcile()
    assert r.answered == 40 and r.pending == r.unknown == 0
    assert r.total_usd == pytest.approx(billed, abs=1e-4)
    ends = [x for x in _lines(RunDir(cfg.run_dir)) if x["e"] in ("end", "settle")]
    assert {x["s"] for x in ends} == {"pending", "generation"}  # looked up, never taken as $0


def _answer(usage: Usage, priced: bool) -> ChatAnswer:
    return ChatAnswer("hi", None, None, "stop", "stop", "P", "m", None, usage, 0.1, priced=priced)


class _Looked:
    """What a settler was handed to look up (billing's `_Settles`)."""

    def __init__(self) -> None:
        self.items: list = []

    def add(self, items) -> None:
        self.items.extend(items)


def test_a_runs_answer_is_booked_as_the_five_steps_booked_it(tmp_path):
    """book_answered (a run's answer: RunTerms.answered) books each kind of answer as book_answer, look_up,
    as_booked and over_reservation do one after the other: the same ledger lines, the same answer as booked
    (its cost in the record), the same amount past its reservation, the same look-ups handed on."""
    prices = Prices(1e-6, 4e-6, 0.0, "test")
    cases = [  # (usage, priced, reservation, generation id, prices)
        (Usage(100, 500, 0, 0.002), True, 0.01, None, prices),      # priced, within its reservation
        (Usage(100, 500, 0, 0.05), True, 0.01, "gen-1", prices),    # priced, past it
        (Usage(100, 500, 0, 0.0), True, 0.01, None, prices),        # a free answer
        (Usage(100, 500), False, 0.01, None, prices),               # unpriced: its tokens at the worst prices
        (Usage(100, 5000), False, 0.01, None, prices),              # ... past its reservation
        (Usage(), False, 0.01, None, prices),                       # no counts: its reservation
        (Usage(100, 500), False, 0.01, "gen-2", prices),            # pending until its record prices it
        (Usage(100, 500), False, 0.0, None, None),                  # no price known: $0
        (Usage(100, 500), False, 0.0, "gen-3", None),               # ... looked up
    ]
    booked = {}
    for way in ("steps", "one"):
        spend = SpendLedger(tmp_path / f"{way}.jsonl")
        spend.open()
        settler = _Looked()
        out = []
        for i, (usage, priced, worst, gen, p) in enumerate(cases):
            t = spend.reserve("a", f"p{i}", worst)
            spend.send(t)
            if gen:
                spend.generation(t, gen)
            answer = _answer(usage, priced)
            if way == "steps":
                look_up(settler, book_answer(spend, t, answer, p))
                answer = as_booked(answer, t, p)
                over = over_reservation(answer, t, p)
            else:
                answer, over = book_answered(spend, t, answer, p, settler)
            out.append((answer.usage, answer.priced, over))
        spend.close()
        lines = [orjson.loads(x) for x in (tmp_path / f"{way}.jsonl").read_bytes().splitlines()]
        booked[way] = (out, [{k: v for k, v in x.items() if k not in ("a", "t")} for x in lines],
                       [(x.prompt_id, x.worst, x.answer) for x in settler.items])
    assert booked["one"] == booked["steps"]
    out, lines, looked = booked["one"]
    assert [over > 0 for _, _, over in out] == [False, True, False, False, True, False, False, False, False]
    assert out[3][0].cost == pytest.approx(2100e-6) and [p for p, _, _ in looked] == ["p6", "p8"]


def test_an_answer_without_a_cost_or_an_id_is_booked_at_tokens_times_the_worst_price(tmp_path):
    """A server that sends neither usage.cost nor X-Generation-Id: the answer is booked at its token
    counts times the worst prices the routing allows (never above its reservation), not at $0."""
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    prices = Prices(1e-6, 4e-6, 0.0, "test")
    t = spend.reserve("a", "p1", 0.01)
    spend.send(t)
    assert book_answer(spend, t, _answer(Usage(100, 500), False), prices) is None
    t2 = spend.reserve("a", "p2", 0.01)
    spend.send(t2)
    book_answer(spend, t2, _answer(Usage(), False), prices)       # no counts either: its reservation
    t3 = spend.reserve("a", "p3", 0.01)
    spend.send(t3)
    book_answer(spend, t3, _answer(Usage(100, 500, 0, 0.0), True), prices)  # a free answer says $0
    # No price known (no ceiling): $0 as an estimate, or, with a generation id, looked up.
    t4 = spend.reserve("a", "p4", 0.0)
    spend.send(t4)
    book_answer(spend, t4, _answer(Usage(100, 500), False), None)
    t5 = spend.reserve("a", "p5", 0.0)
    spend.send(t5)
    spend.generation(t5, "gen-5")
    assert book_answer(spend, t5, _answer(Usage(100, 500), False), None) is not None
    # With an id and a price, pending at the estimate (never above the reservation) until looked up.
    t6 = spend.reserve("a", "p6", 0.01)
    spend.send(t6)
    spend.generation(t6, "gen-6")
    lookup = book_answer(spend, t6, _answer(Usage(100, 500), False), prices)
    assert lookup is not None and lookup.worst == pytest.approx(2100e-6) and lookup.answer
    assert spend.pending_usd == pytest.approx(2100e-6) and spend.reserved_usd == 0
    spend.close()
    # Read back as the next run would (a kill before the record came): the same sums and flags.
    r = SpendLedger.read(tmp_path / "spend.jsonl")
    assert r.pending_usd == pytest.approx(2100e-6) and r.pending[lookup.id].answer
    assert {p.gen for p in r.lookups()} == {"gen-5", "gen-6"}
    rec = r.reconcile()
    assert rec.answered == 4 and rec.total_usd == pytest.approx(100e-6 + 2000e-6 + 0.01)
    ends = [orjson.loads(x) for x in (tmp_path / "spend.jsonl").read_bytes().splitlines() if b'"end"' in x]
    assert [e["s"] for e in ends] == ["estimate", "estimate", "usage.cost", "estimate", "pending", "pending"]
    # Priced from its record, it counts as an answer.
    again = SpendLedger(tmp_path / "spend.jsonl")
    again.open()
    again.settle(again.pending[lookup.id], 0.0015)
    again.close()
    rec = SpendLedger.read(tmp_path / "spend.jsonl").reconcile()
    assert rec.answered == 5 and rec.pending == 1 and rec.total_usd == pytest.approx(0.0121 + 0.0015)


# -- HTTP errors that carry a generation id -----------------------------------------------------


async def test_a_5xx_with_a_generation_id_is_looked_up_and_settles_at_its_record(tmp_path):
    sim_cfg = SimConfig(seed=6, latency_scale=0.02, mean_completion_tokens=150,
                        faults={"500": 0.1, "502": 0.1, "503": 0.1, "524": 0.05})
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 60, "concurrency": 8, "max_tokens": 500}],
                          tables={"budget": {"max_usd": 5.0}, "api": {"generation_lookup_s": 60},
                                  "engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        billed = sim.stats.billed_usd
    lines = _lines(RunDir(cfg.run_dir))
    errors = [x for x in lines if x["e"] == "end" and "st" in x]
    assert errors and {x["st"] for x in errors} == {500, 502, 503, 524}
    settled = {x["a"]: x for x in lines if x["e"] == "settle"}
    assert all(settled[x["a"]]["s"] == "generation" and settled[x["a"]]["c"] == 0 for x in errors)
    r = engine.spend.reconcile()
    # Settled by the run itself: with lookups of 60 s and an end-of-run wait of 10 s, a missing record
    # would have left the attempt pending.
    assert r.pending == r.unknown == 0 and r.total_usd == pytest.approx(billed, abs=1e-4)


async def test_a_5xx_whose_id_never_gets_a_record_settles_at_zero_a_timeout_does_not(tmp_path):
    """No record after generation_lookup_s of 404s: for a 5xx (the response ended the request) nothing
    ran; for a request the client gave up on, the generation may still run, so it stays pending."""
    sim_cfg = SimConfig(seed=8, latency_scale=0.0, fixed_latency_s=0.05, mean_completion_tokens=100,
                        faults={"502": 0.3, "hang": 0.1}, hang_s=3.0, generation_delay_s=3600)
    async with SimServer(sim_cfg, port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 30, "concurrency": 8, "max_tokens": 500}],
                          tables={"budget": {"max_usd": 5.0},
                                  "api": {"stream": True, "generation_lookup_s": 0.5, "request_timeout_s": 1},
                                  "engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        await engine.run()
        # What the run's own end-of-run wait cut short, `draftgen ledger` finishes (the status is on disk).
        await reconcile(cfg, TEST_KEY, lookup_s=0.5)
    lines = _lines(RunDir(cfg.run_dir))
    by_status = {x["a"] for x in lines if x["e"] == "end" and x.get("st") == 502}
    timed_out = {x["a"] for x in lines if x["e"] == "end" and x["o"] == "abandoned" and "st" not in x}
    settled = {x["a"]: x for x in lines if x["e"] == "settle"}
    assert by_status and timed_out
    assert all(settled[a]["s"] == "no record" and settled[a]["c"] == 0 for a in by_status)
    assert not timed_out & set(settled)
    # After a restart the status is still known: the next run's lookups treat it the same way.
    again = SpendLedger.read(RunDir(cfg.run_dir).spend)
    assert {p.id for p in again.pending.values()} == timed_out
    assert not any(p.ended for p in again.pending.values())


def test_which_failures_are_billed(tmp_path):
    """The booking of each kind of failure (billing.py), read back from the file as a restart would."""
    spend = SpendLedger(tmp_path / "spend.jsonl")
    spend.open()
    cases = [  # (generation id, failure, booked as)
        ("gen-1", RequestFailed(ErrorKind.SERVER, "HTTP 502", status=502), "pending"),
        ("gen-2", RequestFailed(ErrorKind.REQUEST_TIMEOUT, "HTTP 408", status=408), "pending"),
        ("gen-6", RequestFailed(ErrorKind.SERVER, "HTTP 524", status=524), "pending"),
        ("gen-3", RequestFailed(ErrorKind.RATE_LIMITED, "HTTP 429", status=429), "refused"),
        (None, RequestFailed(ErrorKind.SERVER, "HTTP 502", status=502), "refused"),
        (None, RequestFailed(ErrorKind.CONNECTION, "TLS handshake failed", unreachable=True), "refused"),
        ("gen-4", RequestFailed(ErrorKind.CONNECTION, "TLS handshake failed", unreachable=True), "refused"),
        ("gen-5", RequestFailed(ErrorKind.TIMEOUT, "no complete answer"), "pending"),
        (None, RequestFailed(ErrorKind.BAD_BODY, "truncated body"), "pending"),
    ]
    for i, (gen, e, _) in enumerate(cases):
        t = spend.reserve("a", f"p{i}", 0.01)
        spend.send(t)
        if gen:
            spend.generation(t, gen)
        book_failure(spend, t, e)
    spend.close()
    ends = [orjson.loads(x) for x in (tmp_path / "spend.jsonl").read_bytes().splitlines() if b'"end"' in x]
    assert [("refused" if e["o"] == "refused" else e["s"]) for e in ends] == [c[2] for c in cases]
    r = SpendLedger.read(tmp_path / "spend.jsonl")
    # Only a 500/502/503 can settle at $0 for want of a record: a 408 or 524 is someone giving up on a
    # generation that may run on, like a timeout.
    assert sorted((p.prompt_id, p.ended) for p in r.pending.values()) == [
        ("p0", True), ("p1", False), ("p2", False), ("p7", False), ("p8", False)]


# -- a request that never left --------------------------------------------------------------------


async def test_a_tls_failure_is_waited_out_not_billed_and_fails_nothing(tmp_path):
    """https:// to a plain-HTTP server: the handshake fails, so nothing is sent. Each try is refused
    (not held at its worst case, which would eat max_usd), the run says why it waits, nothing fails."""
    async with SimServer(SimConfig(seed=1), port=0) as sim:
        url = sim.base_url.replace("http://", "https://")
        cfg = make_config(tmp_path, url, [{"name": "a", "n": 20, "concurrency": 4, "max_tokens": 500}],
                          tables={"budget": {"max_usd": 0.05},
                                  "api": {"prompt_price_per_mtok": 1.0, "completion_price_per_mtok": 4.0},
                                  "engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        waiting = ""
        for _ in range(400):
            await asyncio.sleep(0.02)
            waiting = engine.snapshot().waiting
            if "TLS handshake failed" in waiting and engine.retries > 40:
                break
        # A drain, not stop-now: a stop landing mid-handshake abandons that attempt at its worst case
        # (the client cannot tell a handshake from a request on the wire), which is stop-now's rule.
        engine.drain()
        await asyncio.wait_for(task, 30)
        assert sim.stats.requests_total == 0
    assert "TLS handshake failed" in waiting and "check [api] base_url" in waiting, waiting
    ds = dataset_row(engine, "a")
    assert ds.failed == 0 and ds.skipped == 0
    r = engine.spend.reconcile()
    assert r.pending == r.unknown == 0 and r.total_usd == 0 and r.refused > 40


# -- one writer at a time -------------------------------------------------------------------------


async def test_one_writer_at_a_time_on_the_spend_ledger(tmp_path):
    """A second writer (another run, a smoke test, `draftgen ledger` in another process) would hold the
    ceiling against half the spend: it is refused with the file's name, and a smoke test sends nothing."""
    from draftgen.core.errors import LedgerBusyError

    async with SimServer(SimConfig(seed=2, latency_scale=0.0, mean_completion_tokens=60), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "max_tokens": 400}],
                          tables={"budget": {"max_usd": 5.0}, "tokenizer": {"path": str(_tokenizer())}})
        rd = RunDir(cfg.run_dir)
        holder = SpendLedger(rd.spend)
        holder.open()
        try:
            with pytest.raises(LedgerBusyError, match="spend.jsonl is open in another draftgen process"):
                SpendLedger(rd.spend).open()
            result = await run_smoke(cfg, TEST_KEY)
            assert "not sent: " in result.summary() and "open in another draftgen process" in result.summary()
            assert sim.stats.requests_total == 0
            # `draftgen ledger` beside a run: the ledger as it is, nothing written or priced.
            report = await reconcile(cfg, TEST_KEY, lookup_s=0.5)
            assert "has " in report.busy_note and "nothing looked up" in report.busy_note and report.looked_up == 0
        finally:
            holder.close()
        result = await run_smoke(cfg, TEST_KEY)  # released: the next one opens it
    assert result.passed, result.summary()


async def test_a_run_that_fails_to_open_its_datasets_lets_go_of_the_ledger(tmp_path):
    """A run that stops before its first request (a dataset's records cannot be opened) closes the
    spend ledger, lock included: the next run or smoke test in the same process can open it."""
    from draftgen.core.errors import DraftgenError

    async with SimServer(SimConfig(seed=2, latency_scale=0.0), port=0) as sim:
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 5, "max_tokens": 400}],
                          tables={"budget": {"max_usd": 5.0}})
        rd = RunDir(cfg.run_dir)
        rd.responses("a").mkdir(parents=True)  # a directory where the records file should be
        engine = Engine(cfg, TEST_KEY, seed=1)
        with pytest.raises((DraftgenError, OSError)):
            await engine.run()
        assert not engine.spend.is_open
        again = SpendLedger(rd.spend)
        again.open()  # not LedgerBusyError
        again.close()


@pytest.mark.parametrize("ends", ["release", "close", "both"])
def test_reservations_ended_in_another_order_leave_exactly_nothing_reserved(ends):
    """Worst cases added in one order and taken away in another leave float crumbs (0.1 + 0.2 + 0.3 less
    0.3, 0.1, 0.2 is 2.8e-17): once no reservation is open, nothing is reserved, exactly; a stop now that
    releases some and closes others ends at 0 too."""
    from draftgen.core.generate.money.spend_sums import SpendSums
    sums = SpendSums()
    tickets = [sums.reserve("a", str(i), worst) for i, worst in enumerate((0.1, 0.2, 0.3, 1e-7, 0.7))]
    assert sums.reserved_usd > 1.3
    for i, t in enumerate(tickets[2::-1] + tickets[3:]):
        if ends == "release" or (ends == "both" and i % 2):
            sums.release(t)
        else:
            sums.close(t)
        assert sums.reserved_usd >= 0.0
    assert sums.reserved_usd == 0.0
    assert not sums.close(tickets[0])  # an ended ticket ends once


async def test_a_drain_sends_no_further_attempt_of_a_retry_waiting_for_room_under_max_usd(tmp_path):
    """Retries waiting for max_usd room (every attempt a 502 whose generation is pending at its worst case
    until looked up) are given up by a drain: when the lookups settle the pending attempts at $0 and free
    the room, none of them is sent again."""
    async with SimServer(SimConfig(seed=8, fixed_latency_s=0.05, mean_completion_tokens=100,
                                   generation_delay_s=3600), port=0) as sim:
        # One prompt's reservation, read from its `sent` line, so that max_usd holds three of them.
        probe = make_config(tmp_path / "probe", sim.base_url, [{"name": "a", "n": 1, "max_tokens": 500}],
                            tables={"engine": {"reconstruct": False}})
        await Engine(probe, TEST_KEY, seed=1).run()
        worst = next(x["w"] for x in _lines(RunDir(probe.run_dir)) if x["e"] == "sent")
        sim.update(faults={"502": 1.0})
        cfg = make_config(tmp_path, sim.base_url, [{"name": "a", "n": 10, "concurrency": 2, "max_tokens": 500}],
                          tables={"budget": {"max_usd": round(worst * 3.5, 6)},
                                  "api": {"generation_lookup_s": 3}, "engine": {"reconstruct": False}})
        engine = Engine(cfg, TEST_KEY, seed=1)
        task = asyncio.create_task(engine.run())
        run = engine.datasets["a"]

        def waiting_for_room() -> bool:  # both requests out, neither at the server, backing off or parked
            return run.in_flight == 2 and not (sim.stats.in_flight or engine.backing_off or run.parked)
        try:
            await until(lambda: engine.spend.pending_usd > 2 * worst and waiting_for_room(),
                        "both retries to wait for max_usd room", 30)
            received = sim.stats.requests_total
            engine.drain()
            await asyncio.wait_for(task, 60)
        finally:
            if not task.done():
                engine.stop()
                await task
    assert sim.stats.requests_total == received, "a retry waiting for room was sent after the drain"
    assert run.in_flight == 0 and engine.spend.reserved_usd == 0
